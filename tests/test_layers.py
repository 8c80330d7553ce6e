"""The package layout holds DESIGN.md's layer order (issue 46): each package imports only from its own
floor or the floors below it, counting imports inside functions and imports by name.

``python tests/layers.py`` prints the counts (modules, lines, back-arrows, circles)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("dpft_layers", Path(__file__).with_name("layers.py"))
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)

#: Back-arrows left when the layout moved (issue 46 item 5): each is a concern still to move to its
#: floor. The list only shrinks: a new back-arrow fails, and a fixed one must be struck from it. Empty
#: since issue 46's layer commits: every package imports only from its own floor or the floors below.
KNOWN_BACK_ARROWS: set[tuple[str, str]] = set()


def test_every_package_has_a_floor():
    g = layers.graph()
    for mod in g:
        if mod.count("."):
            layers.floor_of(mod)  # raises naming the package that DESIGN.md does not place


def test_no_new_back_arrow():
    arrows = set(layers.back_arrows(layers.graph()))
    new = sorted(arrows - KNOWN_BACK_ARROWS)
    assert not new, f"imports against DESIGN.md's layer order (move the concern to its floor): {new}"


def test_fixed_back_arrows_are_struck():
    arrows = set(layers.back_arrows(layers.graph()))
    gone = sorted(KNOWN_BACK_ARROWS - arrows)
    assert not gone, f"fixed: strike these from KNOWN_BACK_ARROWS so they cannot come back: {gone}"


def test_no_import_circle():
    """0 circles, imports inside functions and imports by name counted (issue 46 goal)."""
    circles = layers.cycles(layers.graph())
    assert not circles, f"import circles (move the concern to its floor, never import it by name): {circles}"


def test_counter_sees_imports_in_functions_and_by_name(tmp_path, monkeypatch):
    pkg = tmp_path / "src" / "dpft"
    (pkg / "step").mkdir(parents=True)
    (pkg / "grads").mkdir()
    for d in (pkg, pkg / "step", pkg / "grads"):
        (d / "__init__.py").write_text("")
    (pkg / "step" / "clip.py").write_text("")
    (pkg / "grads" / "a.py").write_text("def f():\n    from dpft.step import clip\n")
    (pkg / "grads" / "b.py").write_text("import importlib\nM = 'dpft.step.clip'\ndef g():\n    importlib.import_module(M)\n")
    monkeypatch.setattr(layers, "SRC", pkg)
