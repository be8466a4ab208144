"""The docs' computed numbers (tools/docs_numbers.py, issue 47): a number between markers that differs from the
generated one fails, naming the document, the line, the name, what it reads and what the code computes; the docs as
committed hold the generated numbers (the cheap ones recomputed here, the slow ones from docs/numbers.json, which the
slow test recomputes)."""

from __future__ import annotations

import json

import pytest

from tools import docs_numbers as dn


def test_a_wrong_number_is_reported_and_a_rewrite_fixes_it(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\nsmollm2_135m has <!-- n:params.smollm2_135m -->999.9M<!-- /n --> parameters, "
                   "<!-- n:no_such -->1<!-- /n -->\n")
    values = {"params.smollm2_135m": "134.5M"}
    assert dn.differences([doc], values) == [
        "doc.md:2: params.smollm2_135m reads '999.9M', the code computes '134.5M'; run python -m tools.docs_numbers",
        "doc.md:2: no_such is computed by nothing in tools/docs_numbers.py"]
    assert dn.rewrite([doc], values) == [doc]
    assert "<!-- n:params.smollm2_135m -->134.5M<!-- /n --> parameters" in doc.read_text()
    assert dn.differences([doc], values) == ["doc.md:2: no_such is computed by nothing in tools/docs_numbers.py"]


def test_the_docs_hold_the_generated_numbers():
    cache = json.loads(dn.CACHE.read_text())
    values = dn.compute(slow=False, cache=cache)  # parameter counts on the meta device; the dry runs from the cache
    assert values["params.moe_2b"].startswith("1.9") and values["params.tiny_dense"] == "1.8M"  # they really ran
    assert dn.differences(dn.documents(), values) == []
    used = {m["name"] for path in dn.documents() for m in dn.MARKER.finditer(path.read_text())}
    assert used == set(dn.numbers()), "every generated number is quoted, every quoted one generated"
    assert set(cache) == {name for name, n in dn.numbers().items() if n.slow}


@pytest.mark.slow
def test_the_cached_slow_numbers_are_what_the_code_computes_today():
    """The recipes' dry runs and the default suite's collection (minutes on a loaded 2-core machine)."""
    cache = json.loads(dn.CACHE.read_text())
    assert dn.compute(slow=True, cache={}) == dn.compute(slow=False, cache=cache)
