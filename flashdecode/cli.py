"""Command line: ``flashdecode demo | bench {decode,prefill,e2e,serve} | generate | serve``.

Subcommands whose modules are not part of this build are simply not offered. Each module registers itself through
two functions: ``add_arguments(parser)`` and ``run(args) -> int``. A user error (a bad option value, a missing
file, a checkpoint the engine cannot load: ValueError, TypeError, OSError) prints one line and exits with status
2; ``--debug`` shows the traceback instead. Diagnostics go through the ``logging`` module (``--log-level``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time

# subcommand name -> module implementing add_arguments/run
_BENCHES = {
    "decode": "flashdecode.bench.decode",
    "prefill": "flashdecode.bench.prefill",
    "e2e": "flashdecode.bench.e2e",
    "serve": "flashdecode.bench.serve",
}
_GENERATE = "flashdecode.engine.cli"
_SERVE = "flashdecode.engine.server.cli"
# exceptions that mean "the user asked for something that cannot be done": one line, exit status 2
USER_ERRORS = (ValueError, TypeError, OSError, ImportError, MemoryError)


def _optional_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:  # only a missing module of ours is optional; a broken import is a bug
        if e.name is not None and name.startswith(e.name):
            return None
        raise


# ----------------------------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------------------------

def _demo_device():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.cuda.get_device_name()
    mode = "Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "no Triton kernels"
    return torch.device("cpu"), f"CPU ({mode})"


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def demo_rows(device, gen):
    """One dict per algorithm on a small GQA problem: its max |out| and |lse| errors against naive float64
    attention and, for the kernels, the out error of naive attention computed in the kernel's own dtype (the
    FlashAttention rule's yardstick: a kernel should be within 2-3x of it)."""
    import torch

    import flashdecode
    from flashdecode import reference as ref

    batch, seqlen, nheads, nheads_kv, headdim = 2, 97, 8, 2, 64
    q = torch.randn(batch, seqlen, nheads, headdim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seqlen, nheads_kv, headdim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seqlen, nheads_kv, headdim, generator=gen, dtype=torch.float64)
    lens = torch.tensor([seqlen, 40], dtype=torch.int32)
    o_naive, lse_naive = ref.attention_ref(q, k, v, causal=True)
    od_naive, lsed_naive = ref.decode_ref(q[:, -1], k, v, lens)
    rows = []

    def add(name, dtype, fn, want_o, want_lse, same_dtype_fn=None):
        t0 = time.perf_counter()
        o, lse = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        torch_err = _max_err(same_dtype_fn()[0].cpu(), want_o) if same_dtype_fn else None
        rows.append({"algorithm": name, "dtype": str(dtype).replace("torch.", ""), "out_err": _max_err(o.cpu(), want_o),
                     "lse_err": _max_err(lse.cpu(), want_lse), "torch_same_dtype_err": torch_err, "seconds": dt})

    add("blockwise online softmax (reference)", torch.float64,
        lambda: ref.attention_blockwise_ref(q, k, v, causal=True, block_n=16), o_naive, lse_naive)
    add("split-KV (5 splits) + LSE merge (reference)", torch.float64,
        lambda: ref.merge_states_many_ref(*ref.decode_split_ref(q[:, -1], k, v, lens, num_splits=5)),
        od_naive, lsed_naive)

    kdtype = torch.bfloat16  # on the CPU too: the kernels upcast bf16 dots in the interpreter (kernels/dot.py)
    qd, kd, vd = (x.to(device, kdtype) for x in (q, k, v))
    lens_d = lens.to(device)
    if hasattr(flashdecode, "flash_attn"):
        add("flash_attn (Triton, causal)", kdtype,
            lambda: flashdecode.flash_attn(qd, kd, vd, causal=True, return_lse=True), o_naive, lse_naive,
            lambda: ref.attention_ref(qd, kd, vd, causal=True))
    if hasattr(flashdecode, "flash_decode"):
        add("flash_decode (Triton, 4 splits)", kdtype,
            lambda: flashdecode.flash_decode(qd[:, -1], kd, vd, lens_d, num_splits=4, return_lse=True),
            od_naive, lsed_naive, lambda: ref.decode_ref(qd[:, -1], kd, vd, lens_d))
    return rows


def _run_demo(args) -> int:
    import torch

    device, name = _demo_device()
    gen = torch.Generator().manual_seed(args.seed)
    rows = demo_rows(device, gen)
    print(f"flashdecode demo on {name}: batch 2, seqlen 97 (decode lengths 97/40), 8 q heads / 2 kv heads, "
          f"head dim 64, causal")
    header = ("algorithm", "dtype", "max|out err|", "max|lse err|", "torch same-dtype out err", "seconds")
    table = [(r["algorithm"], r["dtype"], f"{r['out_err']:.2e}", f"{r['lse_err']:.2e}",
              "-" if r["torch_same_dtype_err"] is None else f"{r['torch_same_dtype_err']:.2e}",
              f"{r['seconds']:.3f}") for r in rows]
    widths = [max(len(line[i]) for line in table + [header]) for i in range(len(header))]
    for line in [header] + table:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    print("errors are against naive softmax(QK^T)V in float64; 'torch same-dtype' is that naive attention run in "
          "the kernel's dtype")
    return 0


# ----------------------------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse with defaults in every --help and usage errors on one line (exit status 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_module(sub, name: str, module, help_text: str | None = None) -> None:
    doc = (module.__doc__ or "").strip()
    p = sub.add_parser(name, help=help_text or (doc.splitlines()[0] if doc else None), description=doc or None,
                       formatter_class=_HelpFormatter)
    module.add_arguments(p)
    p.set_defaults(func=module.run)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown; module docstrings (with their examples) kept as written."""


def build_parser() -> argparse.ArgumentParser:
    from flashdecode import __version__

    parser = _Parser(prog="flashdecode", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"flashdecode {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors (and debug logging)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("demo", help="run the kernels and the reference on a small problem and print their errors")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, modname in _BENCHES.items():
        mod = _optional_module(modname)
        if mod is not None:
            _add_module(bench_sub, name, mod)

    from flashdecode import warm as warmup_mod

    _add_module(sub, "warmup", warmup_mod, "compile the kernel variants a model's shape needs")
    gen_mod = _optional_module(_GENERATE)
    if gen_mod is not None:
        _add_module(sub, "generate", gen_mod, "generate text with the inference engine")
    serve_mod = _optional_module(_SERVE)
    if serve_mod is not None:
        _add_module(sub, "serve", serve_mod, "serve the engine over an OpenAI-compatible HTTP API")
    return parser


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {text}"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.debug else getattr(logging, args.log_level)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        if args.debug:
            raise
        command = " ".join(filter(None, ("flashdecode", args.command, getattr(args, "bench", None))))
        print(f"{command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
