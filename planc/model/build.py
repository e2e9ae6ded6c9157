"""Build the model a plan is written for, on the meta device, from a reference string.

References are `package.module:callable` (called with no arguments under
`torch.device("meta")`) or `hf:path/to/config.json` (a Hugging Face transformers model built
from its config, no weights, no network; needs the `hf` extra; a relative path starts from the
plan's folder, and a bare name such as `hf:llama-tiny` is a config shipped in `planc/model/configs/`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Callable

import torch
from torch import nn

from planc.model.errors import ModelLoadError


def _import_callable(ref: str) -> Callable[[], nn.Module]:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ModelLoadError(f"`{ref}` is not a model reference; write `package.module:callable` or `hf:config.json`")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`, let a plan name a module in the working dir
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an import can fail in any way; none may reach the user as a traceback
        raise ModelLoadError(f"cannot import `{module_name}`: {type(err).__name__}: {err}") from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            from planc.diagnostics import did_you_mean
            hint = did_you_mean(part, names)
            raise ModelLoadError(f"`{module_name}` has no `{attr}`" + (f"; did you mean `{hint[0]}`?" if hint else ""))
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelLoadError(f"`{ref}` is not callable")
    return obj


def load_callable(ref: str) -> Callable:
    """`package.module:fn` -> the function (an input factory or a loss: `planc explain --inputs`)."""
    return _import_callable(ref)


def build_model(ref: str, *, device: str | torch.device = "meta", base: str | os.PathLike | None = None) -> nn.Module:
    """Build the model `ref` names, on `device` (meta by default: no memory, no init cost).

    `base` is the folder a relative `hf:path/config.json` starts from: pass the plan file's
    folder for a ref read from a plan's `model` line (default: the working directory).
    """
    if ref.startswith("hf:"):
        from planc.model.hf import build_hf_model  # optional extra: only imported when asked for
        return build_hf_model(ref[3:], device=device, base=base)
    builder = _import_callable(ref)
    try:
        with torch.device(device):
            model = builder()
    except Exception as err:
        raise ModelLoadError(f"`{ref}` failed while building the model: {type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"`{ref}` returned a {type(model).__name__}, not an nn.Module")
    return model


def ref_for_plan(ref: str, plan_path: str | os.PathLike | None) -> str:
    """`ref` as the `model` line of a plan written to `plan_path` must spell it.

    A plan resolves a relative `hf:path/config.json` from its own folder, while `--model` on
    the command line starts from the working directory: a plan written elsewhere (`-o
    out/x.plan`) gets the path relative to its folder. Shipped names (`hf:llama-tiny`),
    absolute paths, Python references and plans printed to stdout (`plan_path` None) are kept.
    """
    if plan_path is None or not ref.startswith("hf:"):
        return ref
    path = ref[3:]
    from planc.model.hf import shipped_configs  # optional extra: only imported for hf: refs
    if path in shipped_configs() or os.path.isabs(os.path.expanduser(path)) or not os.path.exists(path):
        return ref
    folder = os.path.dirname(os.path.abspath(plan_path))
    return "hf:" + os.path.relpath(os.path.abspath(path), folder).replace(os.sep, "/")


def rewrite_model_line(text: str, ref: str, plan_path: str | os.PathLike | None) -> str:
    """`text` (a plan naming `ref` on its `model` line) with the line spelt for `plan_path` (`ref_for_plan`)."""
    new = ref_for_plan(ref, plan_path)
    if new == ref:
        return text
    return re.sub(rf"(?m)^model {re.escape(ref)}$", lambda _: f"model {new}", text, count=1)
