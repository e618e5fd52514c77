"""Importance matrices for llama.cpp's quantizer, computed with transformers.

llama.cpp's K-quant and i-quant search minimises a *weighted* rounding error; the
weight of input column j of a linear layer is E[x_j^2], the mean squared activation
feeding that column (llama.cpp tools/imatrix: ``sum += x*x`` over every token row of
the matmul's input, ``count += rows``). Columns that carry large activations are
rounded more carefully.

Here the same statistic comes from a forward pre-hook on every ``nn.Linear`` of the
decoder blocks, keyed by the GGUF tensor name the weight is exported as. Q/K/V share
one input (as do gate/up), so their entries are equal, as in llama.cpp. The rope
permutation of Q/K reorders *output* rows only, so input columns line up.

Files use llama.cpp's GGUF imatrix format (what ``llama-imatrix`` writes by default
and ``llama-quantize --imatrix`` reads): ``general.type = "imatrix"``, keys
``imatrix.datasets``/``chunk_count``/``chunk_size``, and per weight two F32 tensors
``<name>.in_sum2`` (ne = [n_cols, n_mat]) and ``<name>.counts`` (ne = [1, n_mat]).
The legacy ``.dat`` layout is read too.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmctl.errors import GGUFError

Progress = Callable[[int, int], None]


@dataclass
class ImatrixEntry:
    sums: np.ndarray  # float64 [n_cols]: sum over tokens of x_j^2
    count: int  # tokens seen

    def values(self) -> np.ndarray:
        """Mean squared activation per column: what llama_model_quantize consumes."""
        if self.count == 0:
            return np.ones_like(self.sums, dtype=np.float32)
        return (self.sums / self.count).astype(np.float32)


@dataclass
class Imatrix:
    entries: dict[str, ImatrixEntry]  # GGUF weight name -> statistics
    datasets: list[str]
    chunk_count: int
    chunk_size: int

    def values(self) -> dict[str, np.ndarray]:
        return {name: e.values() for name, e in self.entries.items()}

    def describe(self) -> dict:
        return {"entries": len(self.entries), "datasets": self.datasets,
                "chunks": self.chunk_count, "chunk_size": self.chunk_size}


def linear_names(model, gguf_names: dict[str, str]) -> dict[str, str]:
    """Module name -> GGUF weight name for every decoder-block linear layer."""
    import torch

    out = {}
    for name, module in model.named_modules():
        gguf_name = gguf_names.get(f"{name}.weight")
        if isinstance(module, torch.nn.Linear) and gguf_name and gguf_name.startswith("blk."):
            out[name] = gguf_name
    return out


def collect(model, windows: list[list[int]], gguf_names: dict[str, str],
            progress: Progress | None = None) -> dict[str, ImatrixEntry]:
    """Run ``windows`` through ``model`` and accumulate per-column sums of x^2."""
    import torch

    modules = dict(model.named_modules())
    targets = linear_names(model, gguf_names)
    entries: dict[str, ImatrixEntry] = {}
    handles = []

    def hook_for(gguf_name: str):
        def hook(module, args) -> None:
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1]).to(torch.float64)
            entry = entries.get(gguf_name)
            if entry is None:
                entry = entries[gguf_name] = ImatrixEntry(np.zeros(x.shape[-1]), 0)
            entry.sums += (x * x).sum(dim=0).numpy()
            entry.count += x.shape[0]
        return hook

    for module_name, gguf_name in targets.items():
        handles.append(modules[module_name].register_forward_pre_hook(hook_for(gguf_name)))
    try:
        with torch.inference_mode():
            for done, window in enumerate(windows, start=1):
                model(torch.tensor([window]), use_cache=False)
                if progress:
                    progress(done, len(windows))
    finally:
        for handle in handles:
            handle.remove()
    return entries


def compute_imatrix(model_dir: Path, calibration: str, *, samples: int = 32,
                    seq_len: int = 512, seed: int = 0, field: str = "text",
                    progress: Progress | None = None) -> Imatrix:
    """The importance matrix of the checkpoint in ``model_dir`` on ``calibration`` text."""
    import json

    from llmctl.data.sources import load_text_source, sample_windows, token_stream
    from llmctl.models.architectures import expand_tensor_names, get_architecture
    from llmctl.models.loading import load_model, load_tokenizer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = get_architecture(config["model_type"], refuse_moe="the importance matrix")
    names = expand_tensor_names(arch, config["num_hidden_layers"])
    source = load_text_source(calibration, field)
    tokenizer = load_tokenizer(model_dir)
    windows = sample_windows(token_stream(tokenizer, source), seq_len=seq_len, num=samples,
                             seed=seed)
    model = load_model(model_dir, "float32")
    entries = collect(model, windows, names, progress)
    return Imatrix(entries, [source.spec], len(windows), seq_len)


def save_imatrix(imatrix: Imatrix, path: Path) -> Path:
    """Write ``imatrix`` in llama.cpp's GGUF imatrix format (atomically)."""
    import gguf

    from llmctl.utils.atomic import atomic_path

    with atomic_path(Path(path)) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch="")
        writer.kv_data[0].pop("general.architecture", None)  # not a model file
        writer.add_type(gguf.GGUFType.IMATRIX)
        writer.add_array(gguf.Keys.IMatrix.DATASETS, imatrix.datasets)
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, imatrix.chunk_count)
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, imatrix.chunk_size)
        for name in sorted(imatrix.entries):  # llama-imatrix sorts names too
            entry = imatrix.entries[name]
            writer.add_tensor(f"{name}.in_sum2", entry.sums.astype(np.float32).reshape(1, -1))
            writer.add_tensor(f"{name}.counts", np.array([[entry.count]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return Path(path)


def _load_gguf(path: Path) -> Imatrix:
    import gguf

    reader = gguf.GGUFReader(path)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32)
        if t.name.endswith(".in_sum2"):
            sums[t.name[: -len(".in_sum2")]] = data
        elif t.name.endswith(".counts"):
            counts[t.name[: -len(".counts")]] = data.reshape(-1)
    if sums.keys() != counts.keys():
        raise GGUFError(f"{path}: in_sum2 and counts tensors do not pair up",
                        "the imatrix file is damaged; compute it again")
    entries = {}
    for name, s in sums.items():
        c = counts[name]
        if c.size != 1:
            raise GGUFError(f"{path}: {name} has {c.size} expert counts",
                            "mixture-of-experts imatrices are not supported by llmctl")
        entries[name] = ImatrixEntry(s.reshape(-1).astype(np.float64), round(float(c[0])))

    def field(key, default):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    return Imatrix(entries, list(field("imatrix.datasets", [])),
                   int(field("imatrix.chunk_count", 0)), int(field("imatrix.chunk_size", 0)))


def _load_legacy(path: Path) -> Imatrix:
    """llama.cpp's original .dat: n, then per entry (len, name, ncall, nval, floats).

    The stored values are already means scaled by ncall, so sums/ncall recovers
    the mean (llama-quantize divides the same way)."""
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise GGUFError(f"{path} ends early: not an imatrix file",
                            "pass a GGUF imatrix or a legacy .dat from llama-imatrix")
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    (n,) = take("<i")
    if n < 1:
        raise GGUFError(f"{path} holds no imatrix entries", "compute the imatrix again")
    entries = {}
    for _ in range(n):
        (length,) = take("<i")
        name = data[pos:pos + length].decode("utf-8", errors="replace")
        pos += length
        ncall, nval = take("<ii")
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float64)
        pos += 4 * nval
        entries[name] = ImatrixEntry(values, max(ncall, 0)) if ncall > 0 else \
            ImatrixEntry(values, 1)
    chunks, datasets = 0, []
    if pos + 4 <= len(data):
        (chunks,) = take("<i")
        if pos + 4 <= len(data):
            (length,) = take("<i")
            datasets = [data[pos:pos + length].decode("utf-8", errors="replace")]
    return Imatrix(entries, datasets, chunks, 0)


def load_imatrix(path: Path) -> Imatrix:
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"no imatrix file at {path}", "pass the path llama-imatrix or llmctl wrote")
    with open(path, "rb") as f:
        magic = f.read(4)
    return _load_gguf(path) if magic == b"GGUF" else _load_legacy(path)
