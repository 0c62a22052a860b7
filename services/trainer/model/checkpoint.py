"""Trainer checkpoints with torch.distributed.checkpoint: loadable on a different mesh shape, checked before use.

Layout of a checkpoint directory:
  dcp/                 model + optimizer of the actor (and critic), keyed by parameter FQN (DCP, resharded on load)
  trainer_state.json   schedulers, fp16 loss scalers, optimizer-step counts, weight version, the saving mesh (rank 0)
  rng/rank{r}.pt       torch RNG state of each rank (a plain tensor; restored where the rank exists)
  manifest.json        size and crc32 of every file above, written last: a checkpoint without it is incomplete

Nothing here runs code from a checkpoint: the state is JSON, tensors load with torch.load(weights_only=True),
and DCP's pickled `.metadata` is read by an unpickler that builds only DCP's own metadata types (SAFE_GLOBALS).
Every rank's part of a save or load ends in an exchange of errors (`_together`), so a rank that failed answers
the caller through rank 0 instead of leaving the other ranks in a collective.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from isal import isal_zlib
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from services.common.errors import FailedPrecondition, MeshError, NotFound, passes_through, path_error

log = logging.getLogger("meshrl.trainer")

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
CHUNK = 16 * 2**20

# The only globals DCP's `.metadata` pickle may name (torch 2.x writes exactly these); anything else is refused.
_DCP_META = "torch.distributed.checkpoint.metadata"
SAFE_GLOBALS = {(_DCP_META, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                         "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


class DamagedCheckpoint(FailedPrecondition):
    """A checkpoint whose files are missing, changed or not what meshrl writes; the message names the file."""


# ---- refusing what is not ours --------------------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata types and torch dtypes only; any other global is refused by name before it loads."""

    def find_class(self, module: str, name: str):
        dtype = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in SAFE_GLOBALS or isinstance(dtype, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not a checkpoint metadata type")


class SafeReader(dcp.FileSystemReader):
    """DCP's reader with its metadata read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(dcp.DefaultLoadPlanner):
    """DCP's planner with non-tensor items (optimizer hyper-parameters) read by torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# ---- paths and errors -----------------------------------------------------------------------------------

def check_target(path: str, what: str) -> None:
    """Before a save or an export: refuses a path that is a file or lies under one, naming both."""
    if not path:
        raise ValueError("path: empty")
    p = Path(path)
    if p.is_file():
        raise ValueError(f"path: cannot {what} {path!r}: it is a file, not a folder")
    for parent in p.parents:
        if parent.is_file():
            raise ValueError(f"path: cannot {what} {path!r}: {str(parent)!r} is a file, not a folder")
    if (p / "dcp").is_file() and what == "save checkpoint":
        raise ValueError(f"path: cannot {what} {path!r}: {str(p / 'dcp')!r} is a file where the "
                         f"checkpoint's dcp/ folder belongs")


@contextmanager
def file_errors(what: str):
    """File-system errors of a step that only rank 0 runs (an export), as errors naming the path and the cause."""
    try:
        yield
    except OSError as e:
        raise path_error("path", what, e) from None


def _as_domain(exc: BaseException, what: str) -> Exception:
    """Any failure of a checkpoint step as a (picklable) domain error naming the path and the cause."""
    failures = getattr(exc, "failures", None)          # torch's CheckpointException: {rank: (exc, trace)}
    if isinstance(failures, dict) and failures:
        _, (inner, _) = min(failures.items(), key=lambda kv: kv[0])      # the lowest failing rank's error
        return _as_domain(inner, what)
    # Rebuilt as the plain class: the error crosses ranks pickled, and some subclasses take other arguments.
    if isinstance(exc, MeshError):
        return type(exc)(str(exc))
    if isinstance(exc, ValueError):
        return ValueError(str(exc))
    if isinstance(exc, OSError):
        return path_error("path", what, exc)
    if what.startswith("load"):
        return DamagedCheckpoint(f"path: cannot {what}: {type(exc).__name__}: {_first_line(exc)}")
    return MeshError(f"path: cannot {what}: {type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _together(what: str, fn: Callable[[], Any]) -> Any:
    """Runs one step of a collective save/load on this rank, then every rank learns whether any rank failed and
    raises the first failure (so rank 0 answers the caller and no rank waits in a later collective)."""
    error = None
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        if passes_through(e):
            raise
        error = _as_domain(e, what)
    if dist.get_world_size() > 1:
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return result


# ---- integrity ------------------------------------------------------------------------------------------

def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = isal_zlib.crc32(chunk, crc)
    return crc


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
                  and not p.name.endswith(".tmp"))


def _checksums(root: Path, rank: int, world_size: int) -> dict[str, dict]:
    """This rank's share of the files' sizes and checksums (the files are split over the ranks)."""
    return {name: {"bytes": (root / name).stat().st_size, "crc32": _crc(root / name)}
            for name in _files(root)[rank::world_size]}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: str) -> dict[str, dict]:
    """The manifest's {file: {bytes, crc32}}; refuses a missing or malformed one by name."""
    root = Path(path)
    _check_source(path)
    if not (root / MANIFEST).is_file():
        raise DamagedCheckpoint(f"path: {path!r} is not a complete checkpoint: {MANIFEST} is missing (the save "
                                f"did not finish, or the folder is not a meshrl checkpoint)")
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
        assert isinstance(files, dict) and all(_inside(n) and isinstance(v["bytes"], int)
                                               and isinstance(v["crc32"], int) for n, v in files.items())
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise DamagedCheckpoint(f"path: checkpoint {path!r} is damaged: {MANIFEST} is not valid "
                                f"({type(e).__name__})") from None
    return files


def _inside(name: str) -> bool:
    return not (Path(name).is_absolute() or ".." in Path(name).parts)


def _check_source(path: str) -> None:
    p = Path(path)
    for parent in p.parents:
        if parent.is_file():
            raise ValueError(f"path: no trainer checkpoint at {path!r}: {str(parent)!r} is a file, not a folder")
    if p.is_file():
        raise ValueError(f"path: no trainer checkpoint at {path!r}: it is a file, not a folder")
    if not p.exists():
        raise NotFound(f"path: no trainer checkpoint at {path!r}")


def verify(path: str) -> dict:
    """Checks every file against the manifest, then returns the trainer state; refuses by name the first file
    that is missing, changed or not listed. Run on rank 0 before any rank reads the checkpoint."""
    if not path:
        raise ValueError("path: empty")
    root, files = Path(path), read_manifest(path)
    for name in (STATE_FILE, "dcp/.metadata"):
        if name not in files:
            raise DamagedCheckpoint(f"path: checkpoint {path!r} is damaged: {name} is not in its {MANIFEST}")
    for name, want in sorted(files.items()):
        f = root / name
        if not f.is_file():
            raise DamagedCheckpoint(f"path: checkpoint {path!r} is damaged: {name} is missing")
        if f.stat().st_size != want["bytes"]:
            raise DamagedCheckpoint(f"path: checkpoint {path!r} is damaged: {name} has {f.stat().st_size} bytes, "
                                    f"its {MANIFEST} says {want['bytes']} (truncated or replaced)")
        if _crc(f) != want["crc32"]:
            raise DamagedCheckpoint(f"path: checkpoint {path!r} is damaged: {name} does not match its checksum "
                                    f"in {MANIFEST}")
    try:
        shards = {s.relative_path for s in SafeReader(str(root / "dcp")).read_metadata().storage_data.values()}
    except Exception as e:  # noqa: BLE001 - a refused global, or bytes that are not a pickle
        raise DamagedCheckpoint(f"path: checkpoint {path!r} is refused: dcp/.metadata is not DCP metadata "
                                f"({_first_line(e)})") from None
    for shard in sorted(shards):
        if f"dcp/{shard}" not in files:
            raise DamagedCheckpoint(f"path: checkpoint {path!r} is damaged: dcp/{shard} is not in its {MANIFEST}")
    return read_meta(path)


def read_meta(path: str) -> dict:
    """trainer_state.json as a dict (plain JSON: numbers, strings, lists)."""
    try:
        meta = json.loads((Path(path) / STATE_FILE).read_text())
        assert isinstance(meta, dict) and isinstance(meta["models"], dict)
        return meta
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise DamagedCheckpoint(f"path: checkpoint {path!r} is damaged: {STATE_FILE} is not valid "
                                f"({type(e).__name__})") from None


# ---- save and load --------------------------------------------------------------------------------------

def _options(m) -> StateDictOptions | None:
    """A model with frozen weights (LoRA's base) saves and loads only what trains: the adapters."""
    frozen = any(not p.requires_grad for p in m.module.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None


def _state(models: Sequence) -> dict:
    out = {}
    for m in models:
        fresh = not m.optimizer.state
        model_sd, optim_sd = get_state_dict(m.module, m.optimizer, options=_options(m))
        if _options(m) is not None:
            # A frozen weight tied to another (the LM head to the embedding) is still listed: drop it too.
            trainable = {n for n, p in m.module.named_parameters(remove_duplicate=False) if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in trainable}
        if fresh:
            # get_state_dict initialises empty Adam state with a zero-lr step (step=1); undo it so a
            # checkpoint taken before the first update does not change the next update's bias correction.
            m.optimizer.state = defaultdict(dict)
        out[m.name] = {"model": model_sd, "optim": optim_sd}
    return out


def _begin(root: Path, rank: int) -> None:
    if rank == 0:
        # Saving over an older checkpoint (a periodic "latest" save) makes it incomplete until the new manifest.
        (root / MANIFEST).unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "rng").mkdir(exist_ok=True)


def _write_rank_files(root: Path, models: Sequence, rank: int, meta: dict) -> None:
    with open(root / "rng" / f"rank{rank}.pt", "wb") as f:
        torch.save(torch.get_rng_state(), f)
        f.flush()
        os.fsync(f.fileno())
    if rank == 0:
        _write_atomic(root / STATE_FILE, json.dumps(meta, indent=1))


def _trainer_state(models: Sequence, weight_version: int, world_size: int, mesh: str, lora_base: dict | None) -> dict:
    return {"weight_version": weight_version, "world_size": world_size, "mesh": mesh, "lora_base": lora_base,
            "has_critic": any(m.name == "critic" for m in models),
            "models": {m.name: {"step": m.step, "scheduler": m.scheduler.state_dict(),
                                "scaler": m.scaler.state_dict() if m.scaler is not None else None}
                       for m in models}}


def save(path: str, models: Sequence, *, weight_version: int, rank: int, world_size: int, mesh: str,
         lora_base: dict | None = None) -> None:
    """Collective: every rank writes its shards and RNG state; rank 0 the trainer state, then the manifest.
    `lora_base` (a LoRA run: the adapters only are saved) names the base model they train on (model/adapters.py)."""
    root, what = Path(path), f"save checkpoint {path!r}"
    _together(what, lambda: _begin(root, rank))
    _together(what, lambda: dcp.save(_state(models), storage_writer=dcp.FileSystemWriter(
        str(root / "dcp"), overwrite=True)))
    meta = _trainer_state(models, weight_version, world_size, mesh, lora_base)
    _together(what, lambda: _write_rank_files(root, models, rank, meta))
    share = _together(what, lambda: _checksums(root, rank, world_size))
    shares: list = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(shares, share)
    else:
        shares = [share]
    files = {k: v for s in shares for k, v in s.items()}
    _together(what, lambda: rank == 0 and _write_atomic(root / MANIFEST, json.dumps({"files": files}, indent=1)))
    log.info("saved checkpoint to %s (step %d, version %d)", root, models[0].step, weight_version)


def load(path: str, models: Sequence, *, rank: int, aliases: dict[str, str] | None = None) -> int:
    """Collective: restores every model in place and returns the saved weight version. Rank 0 ran verify().

    `aliases` maps a parameter name to another name of the same (tied) tensor: a pipeline's last stage
    keys the tied embedding's optimizer state as lm_head.weight, a one-stage run as model.embed_tokens.weight.
    """
    root, what = Path(path), f"load checkpoint {path!r}"
    meta, listed = _together(what, lambda: (read_meta(path), read_manifest(path)))
    saved = _together(what, lambda: SafeReader(str(root / "dcp")).read_metadata().state_dict_metadata)
    rng = f"rng/rank{rank}.pt"
    # Read before anything is applied. Every rank takes part, also one with no RNG file (a larger mesh than the saver).
    saved_rng = _together(what, lambda: torch.load(root / rng, weights_only=True) if rng in listed else None)
    state = _state(models)
    # Loading into fresh optimizer state needs the initialised structure that _state just undid.
    for m in models:
        state[m.name]["optim"] = get_state_dict(m.module, m.optimizer, options=_options(m))[1]
    own_params = {m.name: [list(g["params"]) for g in state[m.name]["optim"]["param_groups"]] for m in models}
    # Checked before DCP copies the first tensor in place: a checkpoint of another model changes nothing.
    _together(what, lambda: _check_fits(path, saved, state))
    renamed = _rename_aliases(models, state, set(saved), aliases or {})
    _together(what, lambda: dcp.load(state, storage_reader=SafeReader(str(root / "dcp")), planner=SafePlanner()))
    for m in models:
        _restore(m, state[m.name], own_params[m.name], renamed[m.name], meta["models"][m.name])
    if saved_rng is not None:
        torch.set_rng_state(saved_rng)
    log.info("loaded checkpoint %s (step %d, version %d, saved on %s)", root, models[0].step,
             meta["weight_version"], meta["mesh"])
    return int(meta["weight_version"])


def _check_fits(path: str, saved: dict, state: dict) -> None:
    for name, parts in state.items():
        for fqn, t in parts["model"].items():
            size = getattr(saved.get(f"{name}.model.{fqn}"), "size", None)
            if size is not None and tuple(size) != tuple(t.size()):
                raise FailedPrecondition(f"path: checkpoint {path!r} does not fit this model: {name} {fqn} is "
                                         f"{list(size)} there, {list(t.size())} here")


def _rename_aliases(models: Sequence, state: dict, saved_keys: set, aliases: dict[str, str]) -> dict:
    renamed: dict[str, dict[str, str]] = {m.name: {} for m in models}
    for m in models:
        optim_state = state[m.name]["optim"]["state"]
        for fqn in list(optim_state):
            alias = aliases.get(fqn)
            if alias and not any(k.startswith(f"{m.name}.optim.state.{fqn}.") for k in saved_keys) \
                    and alias not in optim_state:
                optim_state[alias] = optim_state.pop(fqn)
                renamed[m.name][alias] = fqn
    return renamed


def _restore(m, state: dict, own_params: list, renamed: dict[str, str], saved: dict) -> None:
    optim_state = state["optim"]["state"]
    for alias, fqn in renamed.items():
        optim_state[fqn] = optim_state.pop(alias)
    # Param groups are plain objects saved once (by one rank): on another mesh their FQN lists can be
    # another stage's. Keep the loaded hyper-parameters, but this rank's parameters.
    for group, params in zip(state["optim"]["param_groups"], own_params):
        group["params"] = params
    set_state_dict(m.module, m.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(m))
    m.scheduler.load_state_dict(saved["scheduler"])
    # A checkpoint of an fp32/bf16 run resumed in fp16 starts from the configured scale.
    if m.scaler is not None and saved.get("scaler"):
        m.scaler.load_state_dict(saved["scaler"])
    m.step = int(saved["step"])
