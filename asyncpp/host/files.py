"""What a tool may write: never one of its own inputs. A data tool names its side files after the user's path
(`<prefix>.json`, `<prefix>.tokenizer.json`), and that name can be the very file it reads; compared resolved
(symlinks, `..`, relative paths), so any spelling of an input is caught before anything is written."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file: the same resolved path, or (both existing) the same inode (a hard link)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.resolve() == pb.resolve():
        return True
    try:
        return pa.exists() and pb.exists() and pa.samefile(pb)
    except OSError:
        return False


def refuse_overwriting_inputs(outputs: Iterable[tuple[str, str | Path]], inputs: Iterable[tuple[str, str | Path]],
                              fix: str) -> None:
    """Raise FileExistsError when an output (option name, path) is one of the inputs (option name, path), or an
    input lies inside an output directory (which the tool fills or removes): the tool would replace what it
    reads. `fix` says what to change."""
    inputs = [(name, Path(path)) for name, path in inputs]
    for out_name, out in outputs:
        out = Path(out)
        for in_name, source in inputs:
            if same_file(out, source):
                what = "the input"
            elif source.expanduser().resolve().is_relative_to(out.expanduser().resolve()):
                what = "a directory holding the input"
            else:
                continue
            raise FileExistsError(f"{out_name} would write {out}, which is {what} {in_name} {source}: it would be "
                                  f"replaced without a word; {fix}")
