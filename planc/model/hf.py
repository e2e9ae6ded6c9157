"""Build Hugging Face transformers models from a config alone: on meta, no weights, no network.

A plan names one with `model "hf:REF"` where REF is either the name of a config shipped with
planc (`hf:llama-tiny`, `hf:llama-3-8b`; see `shipped_configs()`) or a path to a
`config.json` (or a folder holding one). The model class is the config's `architectures[0]`
(e.g. `LlamaForCausalLM`), falling back to `AutoModel` when the config names none.

Models are built in float32 (the dtype of FSDP's sharded master weights; a plan's
`precision` decides the compute dtype) with scaled-dot-product attention, which has a CPU
backward (FlexAttention has none). transformers is the optional extra `hf`.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from planc.limits import MAX_HF_MODULES
from planc.model.errors import ModelLoadError

CONFIG_PACKAGE = "planc.model"
CONFIG_DIR = "configs"

# Config fields that count repeated layers, across model families (llama `num_hidden_layers`,
# gpt2 `n_layer`, t5 `num_layers` + `num_decoder_layers`, bart `encoder_layers` + ...)
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
                "num_encoder_layers", "encoder_layers", "decoder_layers")
# Modules one layer holds, rounded up from the shipped configs (12 to 25 a layer)
MODULES_PER_LAYER = 30


def shipped_configs() -> dict[str, Path]:
    """Name -> path of every config shipped inside the package (`planc/model/configs/*.json`)."""
    folder = resources.files(CONFIG_PACKAGE) / CONFIG_DIR
    return {Path(entry.name).stem: Path(str(entry)) for entry in folder.iterdir()
            if entry.name.endswith(".json")}


def config_path(ref: str, base: str | os.PathLike | None = None) -> Path:
    """The config file `ref` names: a shipped config name, or a file or folder path.

    Args:
        ref: `llama-tiny` (shipped), `path/config.json`, or `path/` holding a `config.json`.
        base: the folder relative paths start from (the plan's folder); default the cwd.
    """
    shipped = shipped_configs()
    if ref in shipped:
        return shipped[ref]
    path = Path(ref).expanduser()
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        from planc.diagnostics import did_you_mean
        hint = did_you_mean(ref, shipped)
        raise ModelLoadError(
            f"no Hugging Face config `{ref}`: not a file" + (f" (looked for `{path}`)" if str(path) != ref else "")
            + (f"; did you mean the shipped config `{hint[0]}`?" if hint else
               "; shipped configs are " + ", ".join(f"`{n}`" for n in sorted(shipped))),
            help=("a relative `hf:` path starts from the plan's own folder"
                  + (f" (`{base}`)" if base is not None else "") + ", not from where planc runs; write "
                  "the path from there, an absolute path, or a shipped name (`hf:llama-tiny`); or pass `--model`"))
    return path


def load_config(path: Path):
    """A `transformers.PretrainedConfig` from a config.json, offline."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read Hugging Face config `{path}`: {err}") from err
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelLoadError(f"`{path}` is not a Hugging Face config: it has no `model_type`")
    transformers = _transformers()
    fields = dict(raw)
    model_type = fields.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except ValueError as err:  # unknown model_type: transformers lists the known ones
        from planc.diagnostics import did_you_mean
        known = list(transformers.CONFIG_MAPPING.keys())
        hint = did_you_mean(model_type, known)
        raise ModelLoadError(f"`{path}`: unknown model_type `{model_type}` for transformers "
                             f"{transformers.__version__}" + (f"; did you mean `{hint[0]}`?" if hint else "")) from err


def layer_counts(config) -> dict[str, int]:
    """`field -> count` for every layer-count field of `config` and of its sub-configs
    (`text_config`, `vision_config`, ...), keyed by dotted field name."""
    found: dict[str, int] = {}

    def walk(fields: dict, prefix: str) -> None:
        for key, value in fields.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif key in LAYER_FIELDS and isinstance(value, int) and not isinstance(value, bool):
                found[prefix + key] = value
    walk(config.to_dict(), "")
    return found


def check_size(config, ref: str) -> None:
    """Refuse, before building, a config whose layer counts describe more than
    `MAX_HF_MODULES` modules: building one takes minutes (about 25 modules a layer)."""
    counts = layer_counts(config)
    estimate = MODULES_PER_LAYER * sum(max(n, 0) for n in counts.values())
    if estimate > MAX_HF_MODULES:
        shown = ", ".join(f"{k} = {v:,}" for k, v in counts.items())
        raise ModelLoadError(
            f"`hf:{ref}` describes about {estimate:,} modules ({shown}), more than planc builds "
            f"({MAX_HF_MODULES:,}): building it would take minutes",
            help=f"check the layer count{'s' * (len(counts) > 1)} in the config ({', '.join(counts)})")


def model_class(config) -> type:
    """The class named by `config.architectures[0]`, or `AutoModel`'s choice."""
    transformers = _transformers()
    names = getattr(config, "architectures", None) or []
    if not names:
        return transformers.AutoModel._model_mapping[type(config)]
    name = names[0]
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        from planc.diagnostics import did_you_mean
        hint = did_you_mean(name, [n for n in dir(transformers) if n.endswith(name[-8:])] or dir(transformers))
        raise ModelLoadError(f"transformers has no model class `{name}` (from `architectures`)"
                             + (f"; did you mean `{hint[0]}`?" if hint else ""))
    return cls


def build_hf_model(ref: str, device: str | torch.device = "meta", *,
                   base: str | os.PathLike | None = None, attn_implementation: str = "sdpa") -> nn.Module:
    """Build the model a Hugging Face config describes, on `device`, without weights or network.

    Args:
        ref: a shipped config name or a path to a config.json (or its folder).
        device: where parameters live; meta (the default) costs no memory and no init time.
        base: folder for relative paths (the plan's folder); default the working directory.
        attn_implementation: "sdpa" (default) or "eager"; both train on CPU.

    Raises:
        ModelLoadError: the config is missing or invalid, describes more modules than
            `planc.limits.MAX_HF_MODULES`, or transformers is not installed.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config never needs the hub; never hang on it
    config = load_config(config_path(ref, base))
    check_size(config, ref)
    # NOTE: transformers' decoders default to `use_cache=True`: each forward fills a KV cache
    # that training never reads, and under activation checkpointing the recomputation appends
    # to it again, so attention sees keys of twice the length (`expected [2, 4, 16, 31]`) and
    # backward fails. planc builds models to train them: the cache is off, as HF trainers set it.
    for sub in (config, *(getattr(config, k) for k in getattr(config, "sub_configs", {}) or {})):
        if getattr(sub, "use_cache", False):
            sub.use_cache = False
    cls = model_class(config)
    try:
        with torch.device(device):
            model = cls._from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    except Exception as err:  # transformers validates configs in many ways; none may be a traceback
        raise ModelLoadError(f"`hf:{ref}`: building {cls.__name__} failed: {type(err).__name__}: {err}") from err
    return model


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ModelLoadError("`hf:` models need Hugging Face transformers: pip install 'planc[hf]'") from err
    transformers.logging.set_verbosity_error()  # config warnings are not the user's plan's problem
    return transformers
