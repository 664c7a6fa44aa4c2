"""Every sparkfleet default, for every host.

Override per group (``group_data/<group>.py``), per host (host data in the inventory)
or per run (``--data key=value``, which wins over everything). ``sparkfleet/config.py``
validates the merged result for every host before anything runs; an unknown key is an
error, so a typo cannot silently fall back to a default.
"""

# --- What to serve -------------------------------------------------------------------
# dense (default): hybrid INT4+FP8 checkpoint + int8 lm-head + DFlash n=12
# dflash: Intel INT4 + DFlash n=12 — agents, tool calls, code (~81 tok/s on agent turns)
# base: Intel INT4 without speculation (28.2 tok/s) · mtp: native MTP-2 head (~40 tok/s)
profile = "dense"
# Serve another repo id than the profile's checkpoint (None: the profile's).
model = None
# repo id -> branch, tag or commit (default: main). sparkfleet.lock records the commit each
# branch or tag resolved to on the first deploy, and every host serves that commit after.
model_revisions = {}
# A checkpoint directory already on the host, served instead of a download (mounted ro).
model_dir = None
# Build the hybrid INT4+FP8 checkpoint on the host instead of downloading the hosted one
# (dense only): fetches the Intel INT4 checkpoint and the FP8 donor's non-expert shards.
build_hybrid = False
# Re-hash every cached weight blob against its ETag on this run (a new blob is always
# hashed once; a truncated one is seen by its size on every run).
verify_weights = False
hybrid_dir = "/var/lib/sparkfleet/hybrid-int4-fp8"

# --- Where it comes from ---------------------------------------------------------------
# The sm121 vLLM 0.23 image with DFlash. The tag is mutable: sparkfleet.lock records the
# digest it resolved to on the first deploy, and every host runs that digest after.
image = "ghcr.io/aeon-7/aeon-vllm-ultimate:2026-06-18-v0.23.0-dflashfix"
# The host's Hugging Face cache (mounted at /hf in the container).
hf_home = "/var/lib/sparkfleet/hf"
# Another hub endpoint (a mirror); None: huggingface.co.
hf_endpoint = None
# Read from the controller's HF_TOKEN when None. Reaches hosts only in a 0600 file.
hf_token = None

# --- The mirror: the image and the weights cross the WAN once -------------------------------
# One host of the inventory is the mirror: it runs an HF mirror (olah) that fetches each
# file from the hub once, and a registry holding a byte-exact copy of the image; the
# other hosts download from it over the LAN, in parallel. "auto": the first host of the
# inventory group `mirror` if there is one, else the first host of the inventory; a host
# name picks that host; None turns it off (every host downloads from upstream itself).
fleet_mirror = "auto"
# How the other hosts reach this host when it serves them, as the mirror or a relay (a name
# or an IPv4/IPv6 address; set it in the host's own host data: each one's differs); None:
# its source address on its route to them (the controller's name may resolve nowhere else).
mirror_address = None
# The HF mirror (olah) and the image registry (Debian/Ubuntu `docker-registry`) on the mirror.
mirror_hf_port = 8090
mirror_registry_port = 5000
# On the mirror host: olah's cache and the registry's storage (each ~ the artifacts' size).
mirror_dir = "/var/lib/sparkfleet/mirror"
# Installed on the mirror from wheels the controller downloads from PyPI for the host's Python.
mirror_olah = "olah==0.5.4"
# The registry's TLS certificate, made once per mirror address on the controller (hosts
# trust it in /etc/docker/certs.d, so docker needs no insecure-registries and no restart).
mirror_tls_dir = ".sparkfleet/mirror-tls"
# How the mirror (and the controller, resolving the fleet lock) reach the image's registry;
# None: https://<the registry in `image`>.
image_registry_url = None
# A second olah on the mirror, offline: it serves its cache only. A host whose download of a
# locked revision upstream refuses (the revision or repo deleted, history rewritten) fetches
# it from there (olah online asks upstream about every file, and relays its 404).
mirror_hf_offline_port = 8089
# Besides what sparkfleet.lock names, the mirror keeps this many artifacts per repository that
# a lock named before (the image's digests, each model's commits), most recent first: a
# redeploy, a rollback (the previous lock from version control) and a new host work after
# upstream moved or deleted them. Older ones are deleted from the mirror. Each kept artifact
# costs its full size (olah stores each commit's files apart; image layers are shared).
mirror_keep_previous = 1
# How many hosts one host serves the image and the weights to. The mirror serves this many
# hosts; each of them that has hosts to serve (a relay) runs the same registry and HF mirror,
# copying from the host above it, so no host's NIC carries more than this many copies and
# a first deploy costs about one WAN copy at any fleet size (README, "Distribution"). 3: a
# WAN of ~1 Gb/s feeds three LAN streams on 10 GbE with room to spare, and 16 hosts are 3
# relay levels deep (32: 3 as well). A relay keeps a second copy: its registry's copy of
# the image (compressed) and its HF mirror's copy of the weights, beside its own. A pair's
# other member always fetches from its partner, over the ConnectX-7 link.
fleet_fanout = 3

# --- The fleet lock: sparkfleet.lock, the bytes every host serves ------------------------------
# Where it lives; None: beside the inventory file (the current directory when the inventory
# is a list of hosts). Commit it with the inventory.
fleet_lock_file = None
# Per run: resolve these references again and roll the fleet to what they name now:
# all, image, or repo ids (comma-separated). With --dry: only show what would move.
fleet_lock_update = []

# --- The fleet endpoint: one OpenAI-compatible URL over every serving host -----------------
# HAProxy (from the host's archives, or apt_repo) on one host of the inventory:
# leastconn over the hosts that answer a real request with the fleet key, clients need the
# same key. "auto": the first host of the inventory group `endpoint`, else none (a router
# is a new port and a new way in on a host: the inventory opts in); a host name picks it.
fleet_endpoint = "auto"
# Where clients call it (port 8000 is the host's own engine); the HAProxy Prometheus
# exporter answers on its own port, at /metrics, with the same key.
endpoint_port = 8080
endpoint_metrics_port = 8405
# Idle time HAProxy allows either side (measured: a stream resets it with every token; a
# silence longer than it is cut, 504 before the first byte). A stream is silent while it
# waits in vLLM's queue and prefills up to 262k tokens (minutes on a GB10); a non-streaming
# answer until its last token: 4 h is a 262k-token answer at ~18.3 tok/s.
endpoint_timeout_s = 14400

# --- The fleet monitor: Prometheus watches the fleet (sparkfleet/monitor.py) -------------------
# Prometheus (Debian/Ubuntu `prometheus`, from the host's archives or apt_repo) on one host
# scrapes every engine's /metrics (with the fleet key), the endpoint's HAProxy exporter and a
# node exporter (`prometheus-node-exporter`) on every host, and evaluates the alert rules.
# "auto": the first host of the inventory group `monitor`, else the fleet endpoint's host
# (the inventory opted in to a router there), else none; a host name picks it; none turns
# it off (and stops what an earlier run set up).
fleet_monitor = "auto"
# Prometheus' web and API (no authentication of its own) answer on the monitor host's
# loopback only: reach them with `ssh -L 9090:127.0.0.1:9090 <monitor host>`, or set an
# address of the host to serve a Grafana on the LAN.
monitor_bind_address = "127.0.0.1"
monitor_port = 9090
# The node exporter's customary port; it listens on each host's fleet address only (the
# address the host has on its route to the monitor host), not on every interface.
node_exporter_port = 9100
# How often every target is scraped and the rules evaluated: Prometheus' customary 15 s.
monitor_scrape_interval_s = 15
# How long a condition must hold before its alert fires: long enough that one slow scrape
# or a rolling restart's few seconds out of rotation (measured: 1.5 s) do not page anyone.
alert_for_s = 120
# Memory, as a warning before the watchdog's stop lines (memory_stop_*): seeds: ~15 GiB free
# under 3-stream load at 0.82, so under 12 GiB available is past what a healthy loaded
# Spark shows; PSI "full" at half the watchdog's stop line is a stall building up.
alert_memory_available_gib = 12.0
alert_psi_full_pct = 5.0
# A filesystem with less free space than this (percent of its size): the next image or
# checkpoint (40-67 GiB) no longer fits a 4 TB Spark's disk at 2%; 10% leaves time to act.
alert_disk_free_pct = 10.0
# The speculative decoder's acceptance length is averaged over this window (with
# rollout_min_acceptance as its floor): ten minutes of agent turns are thousands of drafts.
alert_acceptance_window_s = 600

# --- Pairs: two Sparks cabled by their ConnectX-7 serve one model (tensor parallel) ----------
# A pair is an inventory group named pair_<name>; its hosts' inventory order is their rank
# (pyinfra keeps one order of hosts, where each is first listed), and rank 0, the head,
# serves HTTP. vLLM's own multi-node mode, no Ray: tensor_parallel_size
# is the pair's size. Every member of a pair must serve the same profile, model and image.
# The link's addresses: member r of a pair gets host r+1 of this subnet (each pair is its own
# cable, so pairs may share it); an address plan of NVIDIA's two-Spark playbook.
pair_subnet = "192.168.100.0/24"
# ConnectX-7 supports jumbo frames; NVIDIA's playbook sets 9000 on both ends.
pair_mtu = 9000
# The CX7 netdev to address; "auto": the port ibdev2netdev shows Up (its enp... name).
pair_interface = "auto"
# NCCL_IB_HCA, the RoCE devices NCCL uses; "auto": those of the cabled port.
pair_hcas = "auto"
# The head's rendezvous port (torch.distributed's customary one), on the link only.
pair_master_port = 29500
# Where the link check's NCCL collective meets (the head's running engine holds pair_master_port).
pair_check_port = 29600
# Serve a pair without CUDA graphs (--enforce-eager): cross-node graph capture aborts or hangs at
# replay on GB10 with vLLM of the pinned image's generation (vLLM #46253); the image builder made
# graphs work only in its 0.27.1 image (a capture fix, NCCL >= 2.30.4). False asks for graphs: the
# deploy's in-image check refuses it on an image below pair_graphs_min_vllm / pair_graphs_min_nccl.
pair_enforce_eager = True
# vLLM's custom all-reduce is a single-node NVLink path; the image builder's dual-Spark recipe serves
# with --disable-custom-all-reduce (True renders it; NCCL does the all-reduce over the link).
pair_disable_custom_all_reduce = True
# The cross-node CUDA graph floor: the image builder's 0.27.1 image, "the TP=2 dual-Spark floor" NCCL.
pair_graphs_min_vllm = "0.27.1"
pair_graphs_min_nccl = "2.30.4"
# NCCL_IB_GID_INDEX; "auto": this host's RoCE v2 GID with the link's IPv4 address (show_gids, i.e.
# /sys/class/infiniband/<hca>/ports/1/gids): 3 on a Spark, 5 where IPv6 GIDs sit first. A wrong
# index makes NCCL fall back to sockets without a word (two-Spark recipes pin 3 or 5).
pair_gid_index = "auto"
# The link check's floor: NCCL all_gather bus bandwidth between the members, in GB/s. NVIDIA's
# two-Spark playbook passes a link at 21.875 (87.5% of 200 Gb/s); ~20.4 was measured in the field on a
# direct cable, so a healthy link may need this lowered (data) rather than a new cable.
pair_min_busbw_gbs = 21.875

# --- Serving settings: the reference recipe's validated stack ----------------------------
served_model_name = "qwen"
# Where the API listens. 127.0.0.1 keeps it on the host; 0.0.0.0 serves the network.
bind_address = "0.0.0.0"
port = 8000
max_model_len = 262144
max_num_seqs = 3
max_num_batched_tokens = 8192
# 0.82 leaves ~14-16 GiB to the OS on a 128 GiB Spark; 0.88+ swaps and stalls the host.
# vLLM 0.23 starts only when MemAvailable >= this x MemTotal (0.82: 99.8 GiB of 121.69); a
# headless Spark has 101.3-102.2 GiB available at rest (field reports), the desktop less.
gpu_memory_utilization = 0.82
# The preflight refuses a host only below what vLLM itself checks (gpu_memory_utilization x
# MemTotal) and warns within this of it: what vLLM's process holds before its check (python,
# torch, the CUDA context; 0.82 starts on hosts at 101.3 GiB, so it is under 1.5 GiB).
engine_startup_memory_gib = 1.5
# The OOM guard (earlyoom) kills the engine when MemAvailable falls under this (the
# seeds' monitor: 4 GiB), before a unified-memory OOM freezes the host.
oom_guard_min_available_gib = 4.0

# --- The watchdog: progress, not liveness (sparkfleet/watchdog.py) ---------------------------
# /health stays 200 while an engine is stuck (vLLM #56824, #50011): a systemd service looks at
# /metrics every watchdog_interval_s; requests running or waiting and no token (generated or
# prompt) for wedge_timeout_s is a wedge: the host leaves the endpoint (HAProxy's agent-check
# on watchdog_agent_port) and the engine restarts. Not shorter than the longest silence a
# healthy engine keeps: vLLM counts a prompt's tokens only when its prefill ends, and a
# 262k-token prefill takes minutes on a GB10.
watchdog_interval_s = 5
wedge_timeout_s = 300
# A restart loop ends in a hard reset (one report: 35 restarts, then a physical reset;
# eugr/spark-vllm-docker #257): past this many wedge restarts in the window the engine is
# left stopped and drained, for the operator; the next deploy starts it.
wedge_max_restarts = 3
wedge_restart_window_s = 3600
# Memory, where the kernel reports it: past either line the host is drained and the engine
# stopped cleanly, before the kernel or the driver freezes a unified-memory Spark (NVIDIA
# open-gpu-kernel-modules #1358, dgx-spark-playbooks #97). PSI "full" (every task stalled
# on memory, avg10): systemd-oomd kills at 60% for 20 s, Android's lmkd calls 70% of "full"
# critical; 10% is a sustained stall well before either. MemAvailable: 0.82 leaves 14-16
# GiB to the OS and 0.88+ (~7 GiB less) swaps and stalls the host, so 8 GiB is where the
# stall begins, above earlyoom's 4 GiB kill line. It starts again once PSI full avg10 is
# under 1% and its share of memory plus engine_startup_memory_gib is available.
memory_stop_psi_full_pct = 10.0
memory_stop_available_gib = 8.0
watchdog_agent_port = 8009
# Reads the checkpoint straight to device in ~32 s instead of ~8 min on GB10.
load_format = "fastsafetensors"
attention_backend = "FLASH_ATTN"
# DFlash's drafter is non-causal; FLASH_ATTN is the backend that supports it on sm121.
drafter_attention_backend = "FLASH_ATTN"
# An empty string turns a parser off.
tool_call_parser = "qwen3_xml"
reasoning_parser = "qwen3"
chunked_prefill = True
# Off in the reference recipe's validated stack; on adds the prefix-alignment patch for DFlash.
prefix_caching = False
# None: the profile's depth (12 for DFlash, 2 for MTP); 0 turns speculation off.
num_speculative_tokens = None
# Further `vllm serve` flags, appended verbatim (e.g. ["--kv-cache-dtype", "fp8"]).
extra_serve_args = []
# Extra environment for vLLM in the container (no secrets here: use hf_token/api_key).
vllm_env = {}
# Runtime patches of the image's vLLM. None: the profile's (sparkfleet/profiles.py). A list
# replaces them, e.g. to drop one the deploy's patch check says cannot apply to an image.
patches = None

# --- Access ------------------------------------------------------------------------------
# auto: one key generated per project, kept 0600 in api_key_file and on every host;
# none: no key (trusted network only); anything else: that key.
api_key = "auto"
api_key_file = ".sparkfleet/api-key"

# --- Lifecycle -------------------------------------------------------------------------
# False stops and disables the service on every host, keeping image and weights.
serving = True
# Turn the GB10/aarch64 gate into a warning (other Blackwell hosts, untested).
force = False
# How long READY may take after a (re)start; None: 3 x a cold start of this checkpoint with
# this load_format on a GB10 (runtime/startup.py: ~3 min with fastsafetensors, ~11 without),
# a pair's for its members (two Sparks start slower: the field's 6-15 min; ~19 min wait).
ready_timeout_s = None
# 1: real time. The simulated fleet runs its engine's start-up this much faster (and sets it
# here), so the READY wait and rollout pacing it derives keep their ratios to it.
startup_time_scale = 1.0
# --- Rolling changes (sparkfleet/rollout.py) ----------------------------------------------
# "rolling": a change that restarts the engine of a serving fleet rolls rollout_batch hosts at
# a time (drain from the endpoint, restart, gate, back in rotation), so the rest keep serving
# and a change that fails stops on its first host. "all": every host at once, for a fleet
# that serves no one (a restart is then the whole time-to-READY, not N of them).
rollout = "rolling"
# Hosts per batch: a count, a share of the rolling hosts ("25%", rounded down, at least one),
# or a list whose last value repeats, as Ansible's `serial`. One host at a time: the fleet
# loses at most one replica's capacity during a change, but a turn on a Spark takes ~4 min
# (an estimate, not measured on Sparks: READY ~3 min with fastsafetensors, runtime/startup.py,
# plus drain and gate), so 32 Sparks take ~2 h; [1, "25%"] rolls one host first, then a
# quarter of the fleet at a time: 5 batches, ~20 min, at 75% capacity.
rollout_batch = 1
# Time for a drained host's in-flight requests to finish before its restart cuts them: long
# agent turns (minutes of decode at 262k context) finish within it.
drain_timeout_s = 600
# The gate's floor for a speculative profile's acceptance length (tokens per step, from
# /metrics): a drafter that does not match its model accepts ~1 and only costs time.
rollout_min_acceptance = 1.5
# The gate's floor for one stream's decode rate (tokens/s of its decode request, prefill
# included): a GB10 decodes 28.2 tok/s with no speculation and 33-81 with it (prose to
# agent turns, the reference recipe's tables); half the slowest is a host that is broken, not
# slow (a driver or toolkit upgrade that lost the GPU path, a throttled GPU). 0: no floor.
rollout_min_decode_tok_s = 14.0

# --- The stack: what the host runs under the engine (sparkfleet/stack.py) --------------------
# The NVIDIA driver and its userspace, the NVIDIA Container Toolkit, Docker (engine and
# containerd) and the kernel, as component -> {apt package: version}. Every listed package
# the host has installed is held (apt-mark hold): unattended-upgrades and `apt-get upgrade`
# skip it, so nothing moves the stack behind the fleet (a DGX OS kernel update broke NCCL
# between two Sparks, eugr/spark-vllm-docker #392; a driver userspace update without a reboot
# fails every new GPU container). A package the host lacks is skipped: a Spark has docker-ce
# or docker.io, not both. None holds the version the host runs; a version (as `apt-cache
# policy PACKAGE` lists it) is what every host must run: `sparkfleet status` shows drift.
# DGX OS 7 ships driver 580.x (CUDA 13.0), toolkit 1.17-1.19 and Docker 28.x (29.x after
# updates); its images differ in the exact builds, so the defaults hold what each host runs.
# The driver's names are NVIDIA's 580 branch packages (590 renames them without the branch).
stack_versions = {
    "driver": {"nvidia-driver-580-open": None, "nvidia-dkms-580-open": None, "nvidia-utils-580": None,
               "libnvidia-compute-580": None},
    "toolkit": {"nvidia-container-toolkit": None, "nvidia-container-toolkit-base": None,
                "libnvidia-container1": None, "libnvidia-container-tools": None},
    "docker": {"docker-ce": None, "docker-ce-cli": None, "containerd.io": None, "docker.io": None,
               "containerd": None},
    # The meta-packages that pull each new kernel in.
    "kernel": {"linux-nvidia-hwe-24.04": None, "linux-image-nvidia-hwe-24.04": None},
}

# --- Host preparation ---------------------------------------------------------------------
# NVIDIA's signed apt repository for the container toolkit ($(ARCH) is apt's own).
nvidia_apt_repo = "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)"
nvidia_apt_key_url = "https://nvidia.github.io/libnvidia-container/gpgkey"
# Where hosts get the distribution packages sparkfleet installs (docker-registry and skopeo on
# the mirror, haproxy on the endpoint, earlyoom everywhere) and its signing key; None: the
# host's own archives (Ubuntu main/universe). The same URL as nvidia_apt_repo needs the same key.
apt_repo = None
apt_key_url = None
# Sizes used by the disk preflight, for what is not yet on the host. The image's come
# from its manifest in the registry (compressed); unpacked is this ratio times that (the
# published image: ~50 GB on disk from ~21 GB compressed). image_size_gib (unpacked) is
# used only when a host cannot read the manifest.
image_unpack_ratio = 2.4
image_size_gib = 47.0
artifact_sizes_gib = {
    "Intel/Qwen3.5-122B-A10B-int4-AutoRound": 62.0,
    "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid": 67.0,
    "z-lab/Qwen3.5-122B-A10B-DFlash": 1.6,
    # Only the donor's non-expert shards are fetched for a hybrid build.
    "Qwen/Qwen3.5-122B-A10B-FP8": 12.0,
    "hybrid-build": 67.0,
}
# Head room kept free on every filesystem after the deploy.
disk_margin_gib = 5.0

# --- Post-deploy checks (checks/) ------------------------------------------------------------
# Run after the deploy: any of smoke, tools, decode, e2e, agent. None by default: a
# converged re-run must change nothing, and a check run reports as a change.
checks = []
# What checks/bench.py runs when used on its own: first what a client needs, the model
# answers (smoke) and tool calls work (tools: the most common misconfiguration of this
# stack is a server started without its parsers), then the decode benches.
bench = ["smoke", "tools", "decode", "e2e"]
bench_runs = 3
bench_warmup = 1
bench_max_tokens = 256
# An agent's session database on the controller (Hermes' ~/.hermes/state.db) for the agent-turn bench.
agent_state_db = None
agent_sessions = 10
agent_max_context_tokens = 16384
agent_max_tokens = 200
# Your own prompt, added to the decode bank as workload "user".
bench_prompt = None
bench_timeout_s = 600
# docker: run the benches with the serving image's Python (the host needs only docker);
# host: the host's python3, which then needs prometheus_client.
bench_runner = "docker"
bench_dir = "/var/lib/sparkfleet/bench"
# Results land in results_dir/<run_id>/<host>.json; None: a timestamp per run.
run_id = None
results_dir = "results"

# The names above are what this file exports: pyinfra otherwise parses the file once per
# name to tell its imports from its data (~0.1 s of every run and every status).
__all__ = [name for name in dir() if not name.startswith("_")]
