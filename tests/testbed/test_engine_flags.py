"""The simulated engine accepts no flag, method or parser name that real vLLM 0.23 lacks.

The truth is the vLLM sdist of the serving image's version (tests/support/vllm_source.py,
fetched from PyPI and cached), read with ``ast``:

* ``vllm/engine/arg_utils.py``: every option string in ``EngineArgs.add_cli_args`` /
  ``AsyncEngineArgs.add_cli_args``; a ``--no-`` form exists where the call uses
  ``argparse.BooleanOptionalAction`` or takes its kwargs from ``get_kwargs(SomeConfig)``
  for a bool field of that config class (vLLM's ``get_kwargs`` turns those into
  BooleanOptionalAction).
* ``vllm/entrypoints/openai/cli_args.py``: ``make_arg_parser``'s own options and one
  ``--field-name`` per ``BaseFrontendArgs``/``FrontendArgs`` field (bools with ``--no-``).
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache

from support.vllm_source import VLLM_IMAGE_VERSION, vllm_members, vllm_source_file

from sparkfleet.testbed.engine import flags as engine

ARG_UTILS = "vllm/engine/arg_utils.py"
CLI_ARGS = "vllm/entrypoints/openai/cli_args.py"


def _tree(relpath: str) -> ast.Module:
    return ast.parse(vllm_source_file(VLLM_IMAGE_VERSION, relpath).read_text())


def _class_fields(tree: ast.Module) -> dict[str, dict[str, str]]:
    """{class name: {field: annotation source}} for every class in a module."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                st.target.id: ast.unparse(st.annotation)
                for st in node.body
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
            }
    return out


def _is_bool_flag(annotation: str) -> bool:
    """vLLM's get_kwargs: a bool field becomes --x/--no-x, except ``bool | str | None``
    (an optional-valued flag)."""
    return bool(re.search(r"\bbool\b", annotation)) and not re.search(r"\bstr\b", annotation)


@lru_cache(maxsize=1)
def _config_classes() -> dict[str, dict[str, str]]:
    classes: dict[str, dict[str, str]] = {}
    for rel in vllm_members(VLLM_IMAGE_VERSION):
        if rel.startswith("vllm/config/") and rel.endswith(".py"):
            classes.update(_class_fields(_tree(rel)))
    classes.update(_class_fields(_tree(ARG_UTILS)))
    return classes


def _kwargs_source(call: ast.Call, kwargs_vars: dict[str, str]) -> tuple[str, str] | None:
    """(config class, field) when the call passes ``**x_kwargs["field"]`` (or a dict
    literal that unpacks it), with ``x_kwargs = get_kwargs(Class)``."""
    for kw in call.keywords:
        if kw.arg is not None:
            continue
        value = kw.value
        if isinstance(value, ast.Dict):
            inner = [v for k, v in zip(value.keys, value.values) if k is None]
            value = inner[0] if inner else value
        if (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name)
                and isinstance(value.slice, ast.Constant) and value.value.id in kwargs_vars):
            return kwargs_vars[value.value.id], value.slice.value
    return None


def _options_from_calls(func: ast.AST, classes: dict[str, dict[str, str]]) -> set[str]:
    kwargs_vars: dict[str, str] = {}
    for node in ast.walk(func):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "get_kwargs"
                and isinstance(node.value.args[0], ast.Name)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    kwargs_vars[target.id] = node.value.args[0].id
    flags: set[str] = set()
    for node in ast.walk(func):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        options = [a.value for a in node.args
                   if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")]
        flags.update(options)
        action = next((kw.value for kw in node.keywords if kw.arg == "action"), None)
        boolean = isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction"
        if action is None and (src := _kwargs_source(node, kwargs_vars)):
            boolean = _is_bool_flag(classes.get(src[0], {}).get(src[1], ""))
        if boolean:
            flags.update("--no-" + o[2:] for o in options if o.startswith("--"))
    return flags


def _function(tree: ast.Module, name: str, cls: str | None = None) -> list[ast.AST]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and (cls is None or node.name == cls):
            found += [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name]
        elif cls is None and isinstance(node, ast.FunctionDef) and node.name == name:
            found.append(node)
    return found


@lru_cache(maxsize=1)
def real_serve_flags() -> frozenset[str]:
    """Every option string `vllm serve` has in the real source (long and short)."""
    classes = _config_classes()
    arg_utils, cli_args = _tree(ARG_UTILS), _tree(CLI_ARGS)
    flags: set[str] = set()
    funcs = _function(arg_utils, "add_cli_args", "EngineArgs") + _function(arg_utils, "add_cli_args", "AsyncEngineArgs")
    funcs += _function(cli_args, "make_arg_parser")
    assert len(funcs) == 3, "vLLM's CLI moved: update this test's source map"
    for func in funcs:
        flags |= _options_from_calls(func, classes)
    frontend = _class_fields(cli_args)
    for cls in ("BaseFrontendArgs", "FrontendArgs"):
        for name, annotation in frontend[cls].items():
            if name.startswith("_"):
                continue
            flag = "--" + name.replace("_", "-")
            flags.add(flag)
            if _is_bool_flag(annotation):
                flags.add("--no-" + flag[2:])
    return frozenset(flags)


def test_real_flag_set_is_sane() -> None:
    """Guards the parser above: known real flags present, known non-flags absent."""
    real = real_serve_flags()
    for flag in ("--speculative-config", "--served-model-name", "--max-model-len", "--api-key",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                 "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser", "--attention-backend",
                 "--kv-cache-dtype", "--load-format", "--trust-remote-code", "--no-trust-remote-code", "-tp", "-sc"):
        assert flag in real, flag
    for flag in ("--disable-log-requests", "--no-disable-log-stats", "--no-max-model-len", "--no-hf-token"):
        assert flag not in real, flag


def test_every_engine_flag_is_a_real_vllm_flag() -> None:
    real = real_serve_flags()
    ours = engine.serve_long_flags() | engine.serve_short_flags()
    assert len(ours) > 100  # the sim really mirrors a broad CLI, not a handful of flags
    assert sorted(ours - real) == []


def _literal_strings(tree: ast.Module, name: str) -> set[str]:
    """Strings of a ``Name = Literal[...]`` alias, following nested aliases."""
    aliases = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name)}

    def walk(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name) and node.id in aliases:
            return walk(aliases[node.id])
        if isinstance(node, ast.Subscript):
            return walk(node.slice)
        if isinstance(node, ast.Tuple):
            return set().union(*(walk(e) for e in node.elts))
        return set()

    return walk(aliases[name])


def test_speculative_methods_and_keys_match_vllm() -> None:
    tree = _tree("vllm/config/speculative.py")
    assert engine.SPEC_METHODS == _literal_strings(tree, "SpeculativeMethod")
    assert engine.MTP_METHODS == _literal_strings(tree, "MTPModelTypes")
    fields = _class_fields(tree)["SpeculativeConfig"]
    assert engine.SPEC_CONFIG_KEYS <= set(fields)
    assert {"method", "model", "num_speculative_tokens", "revision", "attention_backend"} <= engine.SPEC_CONFIG_KEYS


def _registry_keys(relpath: str, var: str) -> set[str]:
    for node in _tree(relpath).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == var for t in node.targets):
            assert isinstance(node.value, ast.Dict)
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"{var} not found in {relpath}")


def test_parser_names_match_vllm() -> None:
    assert engine.TOOL_PARSERS == _registry_keys("vllm/tool_parsers/__init__.py", "_TOOL_PARSERS_TO_REGISTER")
    assert engine.REASONING_PARSERS == _registry_keys("vllm/reasoning/__init__.py", "_REASONING_PARSERS_TO_REGISTER")


def test_deploy_argv_of_every_profile_is_accepted() -> None:
    """The argv runtime/serve_args.py builds for each profile parses here and passes the
    startup checks that need no model (parsers, speculative config)."""
    import support.runtime_env as support

    from runtime import serve_args
    real = real_serve_flags()
    for profile in support.PROFILES:
        argv = serve_args.build_serve_argv(support.profile_env(profile))
        assert argv[:2] == ["vllm", "serve"], argv
        args = engine.build_parser().parse_args(engine.normalize_argv(argv[1:]))
        assert args.subparser == "serve"
        assert {a for a in argv if a.startswith("--")} <= real, profile
        assert not args.tool_call_parser or args.tool_call_parser in engine.TOOL_PARSERS
        assert not args.reasoning_parser or args.reasoning_parser in engine.REASONING_PARSERS
        engine.parse_speculative_config(args.speculative_config)


def test_the_image_runs_the_engine_package_as_vllm() -> None:
    from sparkfleet.testbed import image

    files = image.engine_source()
    assert {"serve.py", "flags.py", "perf.py", "api.py"} <= set(files)
    assert image.ENGINE_LAUNCHER.startswith(b"#!/usr/bin/python3\n")
    assert f"from {image.ENGINE_PACKAGE}.serve import main".encode() in image.ENGINE_LAUNCHER
