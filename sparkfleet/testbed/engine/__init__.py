"""Simulated vLLM 0.23 for the sparkfleet testbed: ``vllm serve MODEL [flags]``.

Laid into the simulated serving image as a package beside the real vLLM source, with
``/usr/local/bin/vllm`` calling ``serve.main`` (stdlib only, Python 3.11). It behaves
like vLLM where the deploy and the checks can tell the difference, and nowhere else;
``sparkfleet/testbed/README.md`` lists where it is not faithful.

    flags.py    the ``vllm serve`` command line and names vLLM 0.23 knows
    cache.py    model resolution from the local Hugging Face cache (never downloads)
    perf.py     the GB10 performance model (acceptance, step time, prefill, concurrency)
    text.py     the simulated model: what it writes, in Qwen3's own format; which tool it calls
    tokenizer.py  the synthetic checkpoints' byte-level BPE (trained here) and its reader
    template.py   their chat template, and the same rendering in Python (prompt token counts)
    parsers.py  vLLM's qwen3 reasoning and qwen3_xml tool-call parsers on that output
    metrics.py  ``/metrics`` with vLLM's names
    api.py      the OpenAI-compatible routes over the timed engine
    serve.py    startup, as ``vllm serve`` starts
    multinode.py  vLLM's multi-node mode without Ray: refusals, rendezvous, a lost node
    local.py    the same server in this process, for tests (``SimServer``)

Run it as ``python -m sparkfleet.testbed.engine serve MODEL ...`` on the controller.
"""
