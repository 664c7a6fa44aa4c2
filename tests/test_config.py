"""Validation of the merged data: every error names host, key, value and fix."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkfleet.config import ConfigError, Settings, validate_host_data
from sparkfleet.fleet import validate_fleet

ROOT = Path(__file__).resolve().parents[1]


def defaults() -> dict:
    data = runpy.run_path(str(ROOT / "group_data" / "all.py"))
    return {k: v for k, v in data.items() if not k.startswith("__")}


def error_for(**overrides) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_host_data("spark-7", {**defaults(), **overrides})
    return str(caught.value)


def test_defaults_validate_to_the_dense_profile():
    settings = validate_host_data("spark-1", defaults())
    assert settings.profile == "dense"
    assert settings.gpu_memory_utilization == 0.82


def test_every_default_is_a_setting_and_every_setting_has_a_default():
    assert set(defaults()) == set(Settings.model_fields)


def test_a_mirror_address_the_hosts_containers_cannot_resolve_is_refused_with_its_fix():
    # The weights are fetched by the serving image on the host network: no mDNS resolver.
    message = error_for(mirror_address="spark-01.local")
    assert "spark-7" in message and "`mirror_address` = 'spark-01.local'" in message
    assert "mDNS" in message and "leave it unset" in message
    for usable in ("10.0.0.5", "fd00::5", "mirror.example.com", "spark-01.localdomain"):
        assert validate_host_data("spark-7", {**defaults(), "mirror_address": usable}).mirror_address == usable


def test_unknown_profile_lists_the_valid_ones():
    message = error_for(profile="nonsense")
    assert "spark-7" in message and "`profile` = 'nonsense'" in message
    assert "base, dense, dflash, mtp" in message


def test_gpu_memory_utilization_out_of_range_names_key_value_and_fix():
    message = error_for(gpu_memory_utilization=1.5)
    assert "`gpu_memory_utilization` = 1.5" in message
    assert "0.95" in message and "0.82" in message


def test_unknown_key_suggests_the_close_match():
    message = error_for(max_model_length=1000)
    assert "unknown key `max_model_length`" in message
    assert "did you mean max_model_len" in message


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("port", 70000, "`port` = 70000"),
        ("max_model_len", 300000, "`max_model_len` = 300000"),
        ("num_speculative_tokens", 17, "`num_speculative_tokens` = 17"),
        ("model", "not-a-repo", "org/name"),
        ("image", "Bad Image;rm -rf /", "`image`"),
        ("hf_home", "/tmp/$(reboot)", "`hf_home`"),
        ("bind_address", "0.0.0.0; reboot", "`bind_address`"),
        ("served_model_name", "qwen; reboot", "`served_model_name`"),
        ("extra_serve_args", ["--foo\nbar"], "newline"),
        ("checks", ["smoke", "fastest"], "fastest"),
        ("model_revisions", {"Intel/x": "main; reboot"}, "revision"),
    ],
)
def test_values_that_reach_a_shell_are_validated(key, value, fragment):
    assert fragment in error_for(**{key: value})


def test_warning_above_the_measured_memory_utilization(caplog):
    host = SimpleNamespace(name="spark-2", data=SimpleNamespace(dict=lambda: {**defaults(), "gpu_memory_utilization": 0.9}))
    settings = validate_fleet([host])
    assert settings["spark-2"].gpu_memory_utilization == 0.9
    assert "above the 0.82" in caplog.text


def test_fleet_errors_list_every_bad_host_and_ignore_connector_keys():
    good = SimpleNamespace(name="a", data=SimpleNamespace(dict=lambda: {**defaults(), "ssh_user": "root", "_sudo": True}))
    bad1 = SimpleNamespace(name="b", data=SimpleNamespace(dict=lambda: {**defaults(), "port": 0}))
    bad2 = SimpleNamespace(name="c", data=SimpleNamespace(dict=lambda: {**defaults(), "profile": "x"}))
    with pytest.raises(ConfigError) as caught:
        validate_fleet([good, bad1, bad2])
    message = str(caught.value)
    assert "nothing was changed" in message
    assert "b: `port` = 0" in message and "c: `profile` = 'x'" in message
    assert "a:" not in message


def test_secrets_are_masked_in_errors():
    message = error_for(api_key="tooshort", hf_token="hf_supersecret", profil="dense")
    assert "tooshort" not in message and "hf_supersecret" not in message


def test_build_hybrid_only_for_dense():
    assert "build_hybrid" in error_for(profile="dflash", build_hybrid=True)


def test_speculative_tokens_need_a_speculative_profile():
    assert "no speculative decoder" in error_for(profile="base", num_speculative_tokens=4)


def test_a_serving_command_vllm_would_refuse_fails_validation_naming_the_key():
    message = error_for(extra_serve_args=["--api-key", "sk-not-shown-1234"])
    assert "spark-7: `extra_serve_args`: --api-key is refused" in message and "cannot be built" in message
    assert "Fix: remove that flag from extra_serve_args" in message and "set them as api_key" in message
    assert "sk-not-shown-1234" not in message and "see group_data/all.py" not in message


@pytest.mark.parametrize("key", ["HF_TOKEN", "SF_MODEL", "MY_SECRET", "OPENAI_API_KEY", "VLLM_API_KEY"])
def test_vllm_env_keeps_secrets_and_our_own_keys_out(key):
    assert "`vllm_env`" in error_for(vllm_env={key: "x"})


def test_compile_signature_follows_what_is_compiled():
    base = validate_host_data("s", defaults())
    assert base.compile_signature == validate_host_data("s", defaults()).compile_signature
    for change in ({"profile": "dflash"}, {"num_speculative_tokens": 4}, {"build_hybrid": True},
                   {"image": "registry.example/vllm@sha256:" + "a" * 64}):
        assert validate_host_data("s", {**defaults(), **change}).compile_signature != base.compile_signature


def test_one_apt_url_takes_one_key():
    # apt refuses two lists naming one URL with different Signed-By files: the same URL
    # as NVIDIA's repository must come with the same key, and then both name one keyring.
    from sparkfleet.container_runtime import apt_keyring
    from sparkfleet.hostpaths import ARCHIVE_APT_KEYRING, NVIDIA_APT_KEYRING

    url, key = "http://apt.lan/", "http://apt.lan/gpgkey"
    message = error_for(nvidia_apt_repo=url, nvidia_apt_key_url=key, apt_repo=url.rstrip("/"),
                        apt_key_url="http://other/key")
    assert "spark-7" in message and "apt_key_url = nvidia_apt_key_url" in message
    settings = validate_host_data("spark-1", {**defaults(), "nvidia_apt_repo": url, "nvidia_apt_key_url": key,
                                              "apt_repo": url, "apt_key_url": key})
    assert apt_keyring(settings.nvidia_apt_repo, settings.apt_repo) == ARCHIVE_APT_KEYRING
    assert apt_keyring(defaults()["nvidia_apt_repo"], url) == NVIDIA_APT_KEYRING
    assert apt_keyring(defaults()["nvidia_apt_repo"], None) == NVIDIA_APT_KEYRING


def test_fleet_wide_keys_must_agree_across_hosts():
    from support.fleetdata import fleet

    hosts = fleet(("spark-1", {}), ("spark-2", {"rollout_batch": 2}), ("spark-3", {"rollout_batch": 2}))
    with pytest.raises(ConfigError) as err:
        validate_fleet(hosts)
    text = str(err.value)
    assert "`rollout_batch` differs between hosts" in text and "1 on spark-1" in text
    assert "2 on spark-2, spark-3" in text and "nothing was changed on any host" in text
    assert validate_fleet(fleet(("spark-1", {"rollout_batch": 2}), ("spark-2", {"rollout_batch": 2})))


@pytest.mark.parametrize(("given", "steps"), [
    (1, [1]), ("3", [3]), ("25%", ["25%"]), ([1, "25%"], [1, "25%"]), (["1", " 50% "], [1, "50%"]),
])
def test_rollout_batch_is_counts_and_shares_of_the_fleet(given, steps):
    assert validate_host_data("spark-1", {**defaults(), "rollout_batch": given}).rollout_batch == steps


@pytest.mark.parametrize("given", [0, "0%", "150%", [], True, "[1, 25%]", 2000, "a quarter"])
def test_a_rollout_batch_that_is_no_size_names_the_key_and_the_forms(given):
    text = error_for(rollout_batch=given)
    assert "rollout_batch" in text and "spark-7" in text, text
