"""A CUDA platform for building vLLM's ``vllm serve`` parser where there is no GPU.

``serve.py --check`` runs in the image with no GPU, and vLLM 0.23 cannot build its
command line without a platform: ``DeviceConfig``'s default asks for a device type and,
finding none, raises "Failed to infer device type". This module is a vLLM platform
plugin (entry point group ``vllm.platform_plugins``, declared by the dist-info beside
it): what a GPU gives vLLM, a CUDA platform, and nothing more - no device is queried,
nothing is allocated. vllm_cli.py puts this directory on ``sys.path`` for the check
alone; serving never sees it, and vLLM detects its platform itself.
"""
from vllm.platforms.interface import Platform, PlatformEnum


class ParseOnlyCuda(Platform):
    _enum = PlatformEnum.CUDA
    device_name = device_type = "cuda"
    dispatch_key = "CUDA"
    ray_device_key = "GPU"
    dist_backend = "nccl"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"


def register() -> str:
    return "sf_parse_only_platform.ParseOnlyCuda"
