# sparkfleet — the two commands of the README, and the pieces they are made of.
#   make demo   boot 3 simulated Sparks, deploy, run the checks, print the fleet report
#   make test   the linter, then the whole suite, end-to-end tests on the simulated fleet included
#   make test-unit  the tests that need neither the simulated fleet nor the network
#   make lint   ruff, with the rules in pyproject.toml
# Both run as root (the simulated fleet uses network namespaces and systemd-nspawn).

# One virtual environment per checkout: two checkouts on one machine never share an
# editable install. It sees the system's packages, so a torch already there is reused.
VENV ?= .venv
PYTHON = $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
HOSTS ?= 3
APT_PACKAGES = debootstrap systemd-container docker-registry skopeo iproute2 apt-utils gnupg dpkg-dev curl ca-certificates openssh-client
STAMP = .sparkfleet/deps.stamp

.PHONY: deps demo down status lint test test-unit report

$(STAMP): pyproject.toml Makefile
	@command -v debootstrap >/dev/null && command -v systemd-nspawn >/dev/null && command -v docker-registry >/dev/null && command -v skopeo >/dev/null \
		&& command -v apt-ftparchive >/dev/null && command -v gpg >/dev/null && command -v ssh >/dev/null \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); }
	test -x $(PYTHON) || python3 -m venv --system-site-packages $(VENV)
	$(PYTHON) -m pip install -q -e '.[test]'
	$(PYTHON) -c 'import torch, triton' 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0 triton
	@# promtool, Prometheus' checker, for the monitor's tests: from the distribution's package, not installed
	test -x $(VENV)/bin/promtool || { d=$$(mktemp -d) && (cd $$d && apt-get download -qq prometheus) \
		&& dpkg-deb --fsys-tarfile $$d/prometheus_*.deb | tar -xO ./usr/bin/promtool > $(VENV)/bin/promtool \
		&& chmod 755 $(VENV)/bin/promtool; rc=$$?; rm -rf $$d; exit $$rc; }
	@mkdir -p $(dir $(STAMP)) && touch $(STAMP)

deps: $(STAMP)

demo: deps
	sparkfleet testbed up --hosts $(HOSTS)
	pyinfra -y inventory/testbed.py deploy.py --data checks=smoke,tools,decode,e2e --data run_id=demo
	@echo "Rebuild that report any time: sparkfleet report results/demo"
	@echo "The simulated fleet stays up: try 'sparkfleet testbed status', 'make down' removes it."

down:
	sparkfleet testbed down

status:
	sparkfleet testbed status

lint: deps
	$(PYTHON) -m ruff check .

# Four shards side by side, each on its own fleet (instances N to N+3): tests/shards.py.
test: deps lint
	$(PYTHON) tests/shards.py

# No fleet, no network: passes with the network unplugged, e.g.
#   unshare -n sh -c 'ip link set lo up && make test-unit'   (loopback stays: tests run local servers)
test-unit: deps
	$(PYTHON) -m pytest -ra -m "not e2e and not network" tests
