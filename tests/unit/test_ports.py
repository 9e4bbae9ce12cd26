"""Ports declare what they are; the library reads declarations and capabilities only through `core.ports`.

A draft without ``kind``, a forward draft without ``pairing`` and a target without ``device`` are refused
where `Ports` is built, with a message naming the attribute and what to set (no silent default). The
accessors return what the ports declare, and None (or the documented fallback) for an optional capability a
port lacks. No module of the package outside ``core/ports.py`` probes a port with ``getattr`` or ``hasattr``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import speccycle
import torch
from speccycle.core import Ports
from speccycle.core.ports import (
    DraftCapabilities,
    NoRecurrentState,
    PortDeclarationError,
    draft_kind,
    draft_pairing,
    draft_vocab_size,
    graphed_draft_levels,
    host_draft_levels,
    kv_capacity,
    kv_knows,
    recurrent_pending_rows,
    recurrent_state_lens,
    target_device,
    target_vocab_size,
)
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.memory.recurrent_pool import RecurrentPool
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft, TreeLookupDraft
from speccycle.testing.recurrent import NoisyBlockDraft

ROOT = Path(speccycle.__file__).resolve().parent


def _target(pool=None):
    return HashedNgramTarget(pool or FingerprintPool(num_pages=8), vocab_size=16)


class _Forward:
    vocab_size = 16

    def extend(self, batch, target_hidden):
        raise AssertionError("never run")

    def step(self, batch, parent_hidden):
        raise AssertionError("never run")


class _NoKind(_Forward):
    """A forward draft that forgot its ``kind``."""

    pairing = "shifted"


class _NoPairing(_Forward):
    """A forward draft that forgot its ``pairing``."""

    kind = "forward"


class _NoDevice:
    vocab_size = 16

    def forward(self, batch):
        raise AssertionError("never run")


class _Graphed(DraftCapabilities, NoisyDraft):
    """A forward draft that declares graphed levels."""

    def run_draft_levels(self, fn, *args):
        return fn(*args)


def test_a_draft_without_kind_is_refused_naming_kind_and_its_values():
    pool = FingerprintPool(num_pages=8)
    with pytest.raises(PortDeclarationError) as refused:
        Ports(target=_target(pool), draft=_NoKind(), kv_pool=pool)
    message = str(refused.value)
    assert "_NoKind declares no `kind`" in message
    assert "kind = 'forward'" in message and "'lookup'" in message and "'block'" in message


def test_a_draft_of_an_unknown_kind_is_refused():
    draft = _NoKind()
    draft.kind = "beam"
    pool = FingerprintPool(num_pages=8)
    with pytest.raises(PortDeclarationError, match=r"declares kind='beam': set the class attribute kind = 'forward'"):
        Ports(target=_target(pool), draft=draft, kv_pool=pool)


def test_a_forward_draft_without_pairing_is_refused_naming_pairing():
    pool = FingerprintPool(num_pages=8)
    with pytest.raises(PortDeclarationError, match=r"_NoPairing declares no `pairing`: set pairing = 'shifted'"):
        Ports(target=_target(pool), draft=_NoPairing(), kv_pool=pool)
    draft = NoisyDraft(_target(pool), pairing="causal")
    with pytest.raises(PortDeclarationError, match=r"declares pairing='causal'.*'aligned'"):
        Ports(target=_target(pool), draft=draft, kv_pool=pool)


def test_a_target_without_device_is_refused_naming_device():
    pool = FingerprintPool(num_pages=8)
    with pytest.raises(PortDeclarationError, match=r"_NoDevice declares no `device`: set device to the torch.device"):
        Ports(target=_NoDevice(), draft=TreeLookupDraft(_target(pool)), kv_pool=pool)
    target = _NoDevice()
    target.device = None
    with pytest.raises(PortDeclarationError, match="declares device=None"):
        Ports(target=target, draft=TreeLookupDraft(_target(pool)), kv_pool=pool)
    target.device = "no-such-device"
    with pytest.raises(PortDeclarationError, match="which is no torch.device"):
        Ports(target=target, draft=TreeLookupDraft(_target(pool)), kv_pool=pool)


@pytest.mark.parametrize("pairing", ["shifted", "aligned"])
def test_the_accessors_return_a_forward_drafts_declarations(pairing):
    pool = FingerprintPool(num_pages=8)
    target = _target(pool)
    ports = Ports(target=target, draft=NoisyDraft(target, pairing=pairing), kv_pool=pool)
    assert draft_kind(ports) == "forward" and draft_pairing(ports) == pairing
    assert target_device(ports) == torch.device("cpu")
    assert target_vocab_size(ports) == draft_vocab_size(ports) == 16
    assert graphed_draft_levels(ports) is None and host_draft_levels(ports.draft) is None


def test_lookup_and_block_drafts_pair_as_shifted_and_have_no_graphed_levels():
    pool = FingerprintPool(num_pages=8)
    target = _target(pool)
    for draft, kind in ((TreeLookupDraft(target), "lookup"), (NoisyBlockDraft(target, block_size=3), "block")):
        ports = Ports(target=target, draft=draft, kv_pool=pool)
        assert draft_kind(ports) == kind and draft_pairing(ports) == "shifted"
        assert graphed_draft_levels(ports) is None and host_draft_levels(draft) is None


def test_declared_capabilities_are_returned_and_undeclared_ones_are_none():
    pool = FingerprintPool(num_pages=8)
    target = _target(pool)
    draft = _Graphed(target)
    ports = Ports(target=target, draft=draft, kv_pool=pool)
    assert graphed_draft_levels(ports) == draft.run_draft_levels
    assert graphed_draft_levels(ports)(lambda x: x + 1, 2) == 3
    assert host_draft_levels(draft) is None  # declared by the mixin as absent


def test_a_wrapper_draft_without_its_wrapped_drafts_capabilities_reads_none():
    """A port is what it declares: wrapping a graphed draft in a port that does not forward ``run_draft_levels``
    runs the levels step by step."""

    class Wrapper:
        kind, pairing, vocab_size = "forward", "shifted", 16

        def __init__(self, inner):
            self.inner = inner

    pool = FingerprintPool(num_pages=8)
    target = _target(pool)
    assert graphed_draft_levels(Ports(target=target, draft=Wrapper(_Graphed(target)), kv_pool=pool)) is None


def test_recurrent_pool_reports_through_the_accessors():
    pool = FingerprintPool(num_pages=8)
    target = _target(pool)
    plain = Ports(target=target, draft=TreeLookupDraft(target), kv_pool=pool)
    assert isinstance(plain.recurrent, NoRecurrentState)
    assert recurrent_state_lens(plain, [0, 1]) is None and recurrent_pending_rows(plain, 0) == 0
    states = RecurrentPool(num_layers=1, state_shapes={"h": (1,)}, max_requests=4, max_rows=4)
    ports = Ports(target=target, draft=TreeLookupDraft(target), kv_pool=pool, recurrent=states)
    assert recurrent_state_lens(ports, [0, 1]) == [0, 0] and recurrent_pending_rows(ports, 0) == 0


def test_kv_pool_size_and_known_requests_through_the_accessors():
    target = _target()
    paged = PagedKVPool(num_pages=6, page_size=2)
    ports = Ports(target=target, draft=TreeLookupDraft(target), kv_pool=paged)
    paged.allocate(3, 4)
    paged.release(3, 0)  # allocated, holds no page: the pool still knows it
    assert kv_capacity(ports) == 6 and kv_knows(ports, 3) and not kv_knows(ports, 4)

    class Bare:
        """A pool declaring neither ``num_pages`` nor ``has_request``."""

        page_size, num_free_pages = 2, 5

    ports = Ports(target=target, draft=TreeLookupDraft(target), kv_pool=Bare())
    assert kv_capacity(ports) == 5 and not kv_knows(ports, 3)


def test_a_port_without_vocab_size_is_named():
    pool = FingerprintPool(num_pages=8)
    target = _target(pool)

    class Lookup:
        kind = "lookup"

    ports = Ports(target=target, draft=Lookup(), kv_pool=pool)
    with pytest.raises(PortDeclarationError, match=r"draft port Lookup declares no `vocab_size`"):
        draft_vocab_size(ports)


# ---- no probing outside core/ports.py --------------------------------------------------------------------
# The names under which the package holds ports: the `Ports` value and its fields (also as attributes, e.g.
# ``self.ports``, ``engine.draft``). `bench` instruments engines by wrapping their methods by name; it is left out.
PORT_NAMES = frozenset({"ports", "target", "draft", "kv_pool", "pool", "recurrent"})
CHECKED_LAYERS = ("core", "backends", "statemachine", "engine", "testing", "train")


def _names_a_port(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in PORT_NAMES
    return isinstance(node, ast.Attribute) and node.attr in PORT_NAMES


def port_probes(root: Path = ROOT) -> list[str]:
    """``file:line: call`` for every ``getattr`` / ``hasattr`` on a port outside ``core/ports.py``."""
    found = []
    for layer in CHECKED_LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root)
            if rel == Path("core/ports.py") or any(not part.isidentifier() for part in rel.with_suffix("").parts):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and node.args
                    and _names_a_port(node.args[0])
                ):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_probes_a_port_outside_core_ports():
    probes = port_probes()
    assert not probes, "read port declarations through speccycle.core.ports' accessors:\n" + "\n".join(probes)


def test_the_probe_scan_finds_a_probe(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text('k = getattr(ports.draft, "kind", "forward")\nok = getattr(model, "a")\n')
    assert port_probes(tmp_path) == ["engine/x.py:1: getattr(ports.draft, 'kind', 'forward')"]
