"""Reading PyTorch Flight Recorder dumps (pickle and JSON) into one table, and matching entries across ranks.

Flight Recorder (torch-facts.md, "Flight Recorder") keeps a ring buffer of recent collectives per process:
``torch._C._distributed_c10d._dump_fr_trace()`` returns a pickle, ``_dump_fr_trace_json()`` JSON, both a dict with
``version``, ``pg_config``, ``pg_status`` and ``entries``; NCCL jobs also write it themselves on a timeout
(``TORCH_NCCL_DUMP_ON_TIMEOUT``, one file per rank named ``<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>``). Entries
carry ``profiling_name`` ("gloo:all_reduce", "nccl:all_gather"), ``process_group`` (name, desc),
``collective_seq_id``, ``input_sizes``/``input_dtypes``, ``state`` and ``time_created_ns``. On gloo ``state``
stays "scheduled" and the started/completed times are 0: order and sizes, no durations.

An instance of a collective is identified across ranks by (process group name, ``collective_seq_id``), as
PyTorch's own ``torchfrtrace`` analyzer does. Reading needs no torch.
"""
from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

COLUMNS = ["rank", "group", "group_desc", "seq", "p2p_seq", "is_p2p", "op", "in_bytes", "input_sizes",
           "dtype", "output_sizes", "state", "time_created_ns", "thread_name", "record_id", "frame", "source"]

# Bytes per element for Flight Recorder's dtype names (c10 ScalarType names).
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2, "Char": 1,
                "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Float8_e4m3fn": 1,
                "Float8_e5m2": 1, "UInt16": 2, "UInt32": 4, "UInt64": 8}
_DTYPE_NAMES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Int": "int32",
                "Long": "int64", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}


class _PlainUnpickler(pickle.Unpickler):
    """Flight Recorder pickles hold only dicts, lists, tuples, strings and numbers: refuse anything that would
    import or call code, so reading a stranger's dump is safe."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: not a plain Flight Recorder dump")


class DumpError(Exception):
    """A file is not a readable Flight Recorder dump. The message is one line naming the file."""


def parse_dump(raw: bytes | str | dict, source: str = "<memory>") -> dict:
    """The dump as a dict, whichever form it came in (pickle bytes, JSON bytes/str, already a dict)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, bytes) and raw[:1] == b"\x80":  # pickle protocol 2+ header
        try:
            obj = _PlainUnpickler(io.BytesIO(raw)).load()
        except RecursionError:
            raise DumpError(f"{source}: unreadable pickle (nested too deeply)") from None
        except Exception as e:
            raise DumpError(f"{source}: unreadable pickle ({type(e).__name__}: {e})") from None
    else:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise DumpError(f"{source}: neither a Flight Recorder pickle nor JSON ({e})") from None
        except RecursionError:
            raise DumpError(f"{source}: JSON nested too deeply (not a Flight Recorder dump)") from None
    if not isinstance(obj, dict) or "entries" not in obj:
        raise DumpError(f"{source}: not a Flight Recorder dump (no 'entries')")
    if not isinstance(obj["entries"], (list, tuple)) or not all(isinstance(e, dict) for e in obj["entries"]):
        raise DumpError(f"{source}: 'entries' is a {type(obj['entries']).__name__}, expected a list of entries")
    return obj


def _rank_from_name(path: Path) -> int | None:
    m = re.search(r"(\d+)(?:\.(?:json|pkl|pickle))?$", path.name)
    return int(m.group(1)) if m else None


def _op_name(profiling_name: str) -> str:
    """'nccl:all_reduce' -> 'all_reduce'; 'gloo:all_gather' -> 'all_gather' (the run format's canonical ops)."""
    name = (profiling_name or "").split(":", 1)[-1]
    return {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter_tensor_coalesced": "reduce_scatter",
            "_reduce_scatter_base": "reduce_scatter", "_allgather_base": "all_gather",
            "alltoall_base": "all_to_all", "alltoall": "all_to_all"}.get(name, name)


def entries_frame(dump: dict, rank: int | None, source: str = ""):
    """One row per entry of a parsed dump (columns: COLUMNS)."""
    import pandas as pd

    rank = dump.get("rank", rank)
    rows = []
    for i, e in enumerate(dump.get("entries") or []):
        try:
            rows.append(_entry_row(e, rank, source))
        except (TypeError, ValueError, AttributeError, IndexError, KeyError) as err:
            raise DumpError(f"{source}: entry {i} has fields of the wrong type ({type(err).__name__}: "
                            f"{str(err)[:120]})") from None
    df = pd.DataFrame(rows, columns=COLUMNS)
    for c in ("rank", "seq", "p2p_seq", "in_bytes", "time_created_ns", "record_id"):
        v = pd.to_numeric(df[c], errors="coerce")
        bad = (v.isna() & df[c].notna()) | (v < 0) | (v % 1 != 0) | (v.abs() >= 2.0**63)
        if bad.any():
            raise DumpError(f"{source}: {int(bad.sum())} entr(ies) with an impossible {c} "
                            f"(e.g. {df.loc[bad, c].iloc[0]!r}; expected a whole number >= 0)")
        df[c] = v.astype("Int64")
    return df


def _shapes(e: dict, key: str) -> list:
    shapes = e.get(key) or []
    if not isinstance(shapes, list) or not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
            for s in shapes):
        raise TypeError(f"{key} is not a list of tensor shapes")
    return shapes


def _entry_row(e: dict, rank, source: str) -> dict:
    """One entry's row; the field types are the ones Flight Recorder writes (anything else raises)."""
    pg = e.get("process_group") or ["", ""]
    if isinstance(pg, (str, bytes)) or not isinstance(pg, (list, tuple)):
        raise TypeError(f"process_group is a {type(pg).__name__}")
    sizes = _shapes(e, "input_sizes")
    _shapes(e, "output_sizes")
    dtypes = e.get("input_dtypes") or []
    if not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes):
        raise TypeError("input_dtypes is not a list of names")
    nbytes = 0
    for shape, dt in zip(sizes, dtypes):
        n = 1
        for d in shape:
            n *= d
        nbytes += n * _DTYPE_BYTES.get(dt, 0)
    frames = e.get("frames") or []
    if not isinstance(frames, list) or not all(isinstance(f, dict) for f in frames):
        raise TypeError("frames is not a list of frames")
    return {
        "rank": rank, "group": str(pg[0]), "group_desc": str(pg[1]) if len(pg) > 1 else "",
        "seq": e.get("collective_seq_id"), "p2p_seq": e.get("p2p_seq_id"), "is_p2p": bool(e.get("is_p2p")),
        "op": _op_name(e.get("profiling_name", "")), "in_bytes": nbytes,
        "input_sizes": json.dumps(sizes), "dtype": ",".join(str(_DTYPE_NAMES.get(d, d)) for d in dtypes),
        "output_sizes": json.dumps(e.get("output_sizes") or []), "state": e.get("state"),
        "time_created_ns": e.get("time_created_ns"), "thread_name": e.get("thread_name"),
        "record_id": e.get("record_id"),
        "frame": (f"{frames[-1].get('filename')}:{frames[-1].get('line')} in {frames[-1].get('name')}"
                  if frames else ""),
        "source": source}


def load_dump(path) -> Any:
    """Read one Flight Recorder dump file (pickle or JSON) -> DataFrame, one row per entry (columns: COLUMNS).

    The rank comes from the dump's ``rank`` key where it has one, else from the digits ending the file name
    (``nccl_trace_rank_3``, ``fr_trace_rank_3.json``). Raises DumpError with a one-line message.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DumpError(f"{path}: cannot read ({e.strerror})") from None
    return entries_frame(parse_dump(raw, str(path)), _rank_from_name(path), str(path))


def load_dumps(paths) -> Any:
    """Several dump files or directories of them (every regular file inside) -> one DataFrame."""
    import pandas as pd

    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
        else:
            files.append(p)
    if not files:
        raise DumpError(f"{', '.join(map(str, paths))}: no Flight Recorder dump files")
    frames = [load_dump(f) for f in files]
    seen: dict[int, str] = {}
    for f, df in zip(files, frames):
        for r in df["rank"].dropna().unique():
            if int(r) in seen and seen[int(r)] != str(f):
                raise DumpError(f"{f}: duplicate rank {int(r)} (also in {seen[int(r)]}): dumps of two jobs, "
                                f"or one rank dumped twice?")
            seen[int(r)] = str(f)
    return pd.concat(frames, ignore_index=True)
