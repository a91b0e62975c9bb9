"""Load HF safetensors weights (single file or sharded with model.safetensors.index.json) into an engine model.

Fused projections are declared by the model (``PACKED_MODULES``: HF module name -> (fused module, shard)); every
other tensor is copied to the parameter of the same name. Missing or unexpected tensors raise ValueError listing them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch

# HF buffers that are recomputed, never loaded
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def _target(model: torch.nn.Module, hf_name: str):
    """HF tensor name -> (module, param name, shard or None) in our model, or None if ignored."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
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
        return module, param, shard
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


@torch.no_grad()
def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (hf_name, tensor) pairs into ``model`` (cast to its dtype, moved to its device)."""
    expected = _expected_names(model)
    loaded, unexpected = set(), []
    for name, tensor in weights:
        target = _target(model, name)
        if target is None:
            continue
        if target == "unexpected":
            unexpected.append(name)
            continue
        module, param, shard = target
        if shard is None:
            dest = getattr(module, param)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
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
