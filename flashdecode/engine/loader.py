"""Load HF safetensors weights (single file or sharded with model.safetensors.index.json) into an engine model.

Fused projections are declared by the model (``PACKED_MODULES``: HF module name -> (fused module, shard)); every
other tensor is copied to the parameter of the same name. Missing or unexpected tensors raise ValueError listing them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Iterator

import torch

from flashdecode.engine.config import UNQUANTIZED_ONLY

# HF buffers that are recomputed, never loaded
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# parameter names of quantized checkpoints (AWQ / GPTQ packed ints, their scales and zeros, bitsandbytes and fp8
# scales): refused with a clear message instead of failing to find the parameter
_QUANTIZED_PARAMS = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "input_scale",
                     "weight_zero_point", "weight_packed", "weight_shape", "SCB", "absmax", "quant_map",
                     "quant_state", "nested_absmax")


# owner/name as the hub spells repository ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")
# the files of a checkpoint the engine reads (config, weights, tokenizer, generation config)
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def resolve_model_dir(model: str | Path) -> Path:
    """A checkpoint directory, or a hub id ("Qwen/Qwen3-8B") resolved through huggingface_hub: its snapshot in the
    local HF cache (HF_HUB_CACHE) first, else a download unless the hub is offline (HF_HUB_OFFLINE=1). A hub id
    whose files are absent gives one ValueError line naming it."""
    path = Path(model)
    if path.exists() or not _REPO_ID.match(str(model)):
        return path
    from huggingface_hub import constants, snapshot_download

    repo = str(model)
    try:
        return Path(snapshot_download(repo, local_files_only=True, allow_patterns=_HUB_PATTERNS))
    except Exception:  # LocalEntryNotFoundError (or a half-written cache entry): not usable offline
        pass
    where = f"neither a local directory nor in the local HF cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"model {repo!r}: {where}, and the hub is offline (HF_HUB_OFFLINE=1): its files are absent")
    try:
        return Path(snapshot_download(repo, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # no network, no such repo, gated: one line saying which
        raise ValueError(f"model {repo!r}: {where}, and downloading it failed ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in index order."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in dict.fromkeys(weight_map.values())]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"model_dir {str(model_dir)!r} has neither model.safetensors nor model.safetensors.index.json")


def iter_safetensors(files: list[Path], device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _renamed(model: torch.nn.Module, hf_name: str) -> str | None:
    """The model's name for a checkpoint tensor, by the model's ``WEIGHT_RENAMES`` ((checkpoint prefix, our
    prefix or None = not loaded), first match wins: Gemma 3's image+text checkpoints keep the language model under
    language_model.*); None: not loaded."""
    for prefix, ours in getattr(model, "WEIGHT_RENAMES", ()):
        if hf_name.startswith(prefix):
            return None if ours is None else ours + hf_name[len(prefix):]
    return hf_name


def _target(model: torch.nn.Module, hf_name: str):
    """HF tensor name -> (module, param name, shard or None) in our model, or None if ignored."""
    hf_name = _renamed(model, hf_name)
    if hf_name is None or hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name == "lm_head.weight" and getattr(model, "lm_head", None) is None:
        return None  # tied embeddings: some checkpoints still store the copy
    module_path, _, param = hf_name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    packed = getattr(model, "PACKED_MODULES", {})
    shard = None
    if leaf in packed:
        fused, shard = packed[leaf]
        module_path = f"{parent}.{fused}"
    try:  # a tensor of a layer the config does not have (num_hidden_layers too small) lands here
        module = model.get_submodule(module_path)
    except AttributeError:
        return "unexpected"
    if shard is not None:
        return (module, param, shard) if hasattr(module, param) else "unexpected"
    if hasattr(module, "load_shard"):
        return module, param, ""
    if not hasattr(module, param) or not isinstance(getattr(module, param), torch.Tensor):
        return "unexpected"
    return module, param, None


def _expected_names(model: torch.nn.Module) -> set[str]:
    """Parameter names a checkpoint must fill (fused params by their shards)."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            if hasattr(module, "shard_rows"):
                for shard in module.shard_rows:
                    names.add(f"{module_name}.{param_name}:{shard}")
            else:
                names.add(f"{module_name}.{param_name}")
    return names


def _refuse_quantized(name: str, tensor: torch.Tensor) -> None:
    """ValueError naming a tensor of a quantized checkpoint (by its parameter name or its integer / 8-bit float
    dtype): the engine loads unquantized weights only."""
    param = name.rpartition(".")[2]
    fp8 = tensor.dtype.is_floating_point and tensor.element_size() == 1
    if param in _QUANTIZED_PARAMS or not tensor.dtype.is_floating_point or fp8:
        raise ValueError(f"{name} ({tensor.dtype}) is a quantized checkpoint's tensor; quantized checkpoints are "
                         f"not supported; supported: {UNQUANTIZED_ONLY}")


@torch.no_grad()
def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (hf_name, tensor) pairs into ``model`` (cast to its dtype, moved to its device). A module with a
    ``load_param(param, tensor)`` method converts its tensors itself (GemmaRMSNorm stores 1 + w)."""
    expected = _expected_names(model)
    loaded, unexpected = set(), []
    for name, tensor in weights:
        target = _target(model, name)
        if target is None:
            continue
        _refuse_quantized(name, tensor)
        if target == "unexpected":
            unexpected.append(name)
            continue
        module, param, shard = target
        if shard is None:
            dest = getattr(module, param)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
            if hasattr(module, "load_param"):
                module.load_param(param, tensor)
            else:
                dest.copy_(tensor)
            loaded.add(f"{module_name_of(model, module)}.{param}")
        else:
            module.load_shard(shard, param, tensor)
            loaded.add(f"{module_name_of(model, module)}.{param}:{shard}")
    missing = sorted(expected - loaded)
    if unexpected or missing:
        cfg = getattr(model, "config", None)
        hint = (f" (config.json: num_hidden_layers={cfg.num_hidden_layers}, hidden_size={cfg.hidden_size}, "
                f"vocab_size={cfg.vocab_size}; do they match the weights?)" if cfg is not None else "")
        raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}{hint}")


def module_name_of(model: torch.nn.Module, module: torch.nn.Module) -> str:
    cache = getattr(model, "_module_names", None)
    if cache is None:
        cache = {id(m): n for n, m in model.named_modules()}
        model._module_names = cache
    return cache[id(module)]


def count_tensors(files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            total += len(handle.keys())
    return total


def load_checkpoint(model: torch.nn.Module, model_dir: str | Path, use_tqdm: bool = False) -> None:
    """Load a checkpoint directory's weights into ``model``; ``use_tqdm`` shows a progress bar per tensor."""
    from tqdm.auto import tqdm

    files = checkpoint_files(model_dir)
    weights = iter_safetensors(files)
    if use_tqdm:
        weights = tqdm(weights, total=count_tensors(files), desc="loading weights", unit="tensor",
                       dynamic_ncols=True)
    load_weights(model, weights)
