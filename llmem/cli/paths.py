"""The files a command writes (--plot, --export, validate's --out), checked before any work: a refusal names the
path and the fix, instead of a traceback after the whole plan or trace has run."""

from __future__ import annotations

import os

from llmem.errors import LlmemError

PLOT_FORMATS = ("png", "svg", "pdf")      # what the plots are written as (matplotlib's Agg, SVG and PDF writers)
DEVICE_TYPES = ("cuda", "cpu")           # what `measure` runs on


def check_output_path(flag: str, path: str, example: str = "results.json") -> str:
    """`path` can be written as a file: not empty, not a folder, in a folder that exists and is writable.
    `example`: a file name the refusal offers."""
    if not path:
        raise LlmemError(f"{flag} needs a file path, got an empty one: give e.g. {flag} {example}")
    if "\0" in path or not _encodable(path):
        raise LlmemError(f"{flag} {path!r}: not a file name this system can hold (a NUL or a lone surrogate "
                         "character); give a plain file name")
    full = path                          # as the writer will open it (a quoted ~ is not expanded there either)
    name = os.path.basename(full)
    if not name or os.path.isdir(full):
        raise LlmemError(f"{flag} {path}: is a folder; give a file in it, e.g. "
                         f"{os.path.join(path, example)}")
    folder = os.path.dirname(full) or "."
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise LlmemError(f"{flag} {path}: {folder} is a file, not a folder; write elsewhere")
    if not os.path.isdir(folder):
        if folder.startswith("~"):
            raise LlmemError(f"{flag} {path}: a quoted ~ is not expanded; write the folder out in full")
        raise LlmemError(f"{flag} {path}: folder {folder} does not exist; create it (mkdir -p {folder}) or write "
                         "elsewhere")
    if len(os.fsencode(name)) > _name_max(folder):
        raise LlmemError(f"{flag} {path}: the file name is longer than {_name_max(folder)} bytes; choose a "
                         "shorter one")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        raise LlmemError(f"{flag} {path}: not writable by this user; choose another path")
    return path


def check_plot_path(flag: str, path: str) -> str:
    """An output path whose extension names a format the plots are written in (png, svg, pdf)."""
    check_output_path(flag, path, "plot.png")
    stem, ext = os.path.splitext(os.path.basename(path))
    fix = f"name the file {stem or 'plot'}.png, .svg or .pdf"
    if not ext or ext == ".":
        raise LlmemError(f"{flag} {path}: no extension, so no format; {fix}")
    if ext[1:].lower() not in PLOT_FORMATS:
        raise LlmemError(f"{flag} {path}: cannot write {ext} plots; {fix}")
    return path


def check_device(flag: str, device: str | None) -> str | None:
    """A device `measure` can run on: cpu, cuda or cuda:N (None: cuda if available, else cpu)."""
    if device is None:
        return None
    kind, sep, index = device.partition(":")
    if kind not in DEVICE_TYPES or (sep and (kind != "cuda" or not (index.isascii() and index.isdigit()))):
        raise LlmemError(f"{flag} {device!r}: measure runs on cuda, cuda:N or cpu; choose one of those")
    return device


def _encodable(path: str) -> bool:
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return False
    return True


def _name_max(folder: str) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255
