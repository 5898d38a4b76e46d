"""The ``fxpure`` console script, run for real on small saved programs."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from executorch.exir import to_edge

from adapters import cli, realize
from tests.models import Declines, QOddDepthwise, ResNeXtish, randomize_bn
from tests.quantized import pt2e

FXPURE = str(Path(sys.executable).with_name("fxpure"))


def fxpure(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FXPURE, *map(str, args)], capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("programs")
    programs = {
        "resnext": (randomize_bn(ResNeXtish()), (torch.randn(1, 16, 12, 12),)),
        "declines": (randomize_bn(Declines()), (torch.randn(2, 3, 6, 6),)),
        "plain": (torch.nn.Linear(4, 4), (torch.randn(2, 4),)),
    }
    out = {}
    for name, (model, x) in programs.items():
        out[name] = d / f"{name}.pt2"
        torch.export.save(torch.export.export(model.eval(), x), out[name])
    (d / "garbage.pt2").write_text("not a zip")
    (d / "truncated.pt2").write_bytes(out["resnext"].read_bytes()[:4000])
    with zipfile.ZipFile(d / "other.pt2", "w") as z:
        z.writestr("readme.txt", "a zip, but not a program")
    (d / "model.onnx").write_bytes(b"\x08\x01")
    plain = programs["plain"]
    torch.export.save(to_edge(torch.export.export(plain[0].eval(), plain[1])).exported_program(), d / "edge.pt2")
    return out


def test_explain_table(saved: dict[str, Path]) -> None:
    r = fxpure("explain", saved["declines"], "--rules", "fuse-conv-bn")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # piped: no progress, no library chatter
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["rule", "anchor", "outcome", "module", "source", "reason"]
    declined = [line for line in lines if "  declined  " in line]
    assert len(declined) == 2 and any("conv-output-shared" in d for d in declined)
    assert any("b2 (BatchNorm1d)" in d and "producer-not-conv" in d for d in declined)
    assert "models.py:" in r.stdout  # the source line of the layer
    assert lines[-1] == "fuse-conv-bn: 1 to rewrite, 2 declined (1 conv-output-shared, 1 producer-not-conv)"


class _DepthwiseBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.bn = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.c(x))  # type: ignore[no-any-return]


def test_a_candidate_an_earlier_rule_made_is_shown_with_the_node_it_came_from(tmp_path: Path) -> None:
    path = tmp_path / "dw.pt2"
    torch.export.save(torch.export.export(_DepthwiseBN().eval(), (torch.randn(1, 8, 8, 8),)), path)
    rules = ("--rules", "fuse-conv-bn,split-group-conv")
    table = fxpure("explain", path, *rules)
    assert "split-group-conv  conv2d_bn (from conv2d)  declined" in table.stdout, table.stdout
    doc = json.loads(fxpure("explain", path, *rules, "--json").stdout)
    assert {(c["anchor"], c["origin"]) for c in doc["candidates"]} == {
        ("batch_norm", "batch_norm"),
        ("conv2d_bn", "conv2d"),
    }
    for node in ("conv2d", "conv2d_bn"):  # the program's node, or the one the table shows
        r = fxpure("explain", path, *rules, "--node", node)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("split-group-conv at conv2d_bn"), r.stdout
        assert "declined: depthwise-conv" in r.stdout.splitlines()[0]


def test_explain_node_names_the_candidates_of_other_nodes_it_is_part_of(saved: dict[str, Path]) -> None:
    # found by a hunt: the table said "output of conv2d is also used by relu" (the batch norm's
    # fusion, declined), and --node conv2d said no rule considered conv2d
    rules = ("--rules", "fuse-conv-bn")
    declined = fxpure("explain", saved["declines"], *rules, "--node", "conv2d")
    assert declined.returncode == 0, declined.stderr
    first, message = declined.stdout.splitlines()[:2]
    said = "declined: conv-output-shared (pattern: bn.input/conv)"
    assert first == f"conv2d is part of fuse-conv-bn's candidate at batch_norm: {said}"
    assert message.startswith("  output of conv2d is also used by")
    fused = fxpure("explain", saved["resnext"], *rules, "--node", "conv2d")
    assert fused.stdout == "conv2d is part of fuse-conv-bn's candidate at batch_norm: will rewrite\n"
    doc = json.loads(fxpure("explain", saved["resnext"], *rules, "--node", "conv2d", "--json").stdout)
    assert [(p["rule"], p["anchor"]) for p in doc["part_of"]] == [("fuse-conv-bn", "batch_norm")]


def test_apply_writes_through_a_symlink_and_refuses_what_is_no_file(saved: dict[str, Path], tmp_path: Path) -> None:
    import os
    import stat

    store = tmp_path / "store"
    store.mkdir()
    (store / "v1.pt2").write_text("old")
    link = tmp_path / "latest.pt2"
    link.symlink_to(store / "v1.pt2")
    r = fxpure("apply", saved["plain"], "-o", link)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and (store / "v1.pt2").read_bytes()[:2] == b"PK"  # the file it names, replaced
    fifo = tmp_path / "pipe.pt2"
    os.mkfifo(fifo)
    r = fxpure("apply", saved["plain"], "-o", fifo)
    assert r.returncode == 2 and r.stderr.strip().endswith("pipe.pt2: not a regular file"), r.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    fresh = tmp_path / "new.pt2"
    umask = os.umask(0o022)
    try:
        assert fxpure("apply", saved["plain"], "-o", fresh).returncode == 0
    finally:
        os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644


class _ScaledBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.bn = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return self.bn(self.c(x)) * n  # type: ignore[no-any-return]


def test_verify_compares_programs_with_number_inputs_and_half_precision(tmp_path: Path) -> None:
    model = randomize_bn(_ScaledBN()).eval()
    numbers, half = tmp_path / "numbers.pt2", tmp_path / "half.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(1, 3, 8, 8), 3)), numbers)
    torch.export.save(torch.export.export(model.half(), (torch.randn(1, 3, 8, 8).half(), 1)), half)
    r = fxpure("apply", numbers, "-o", tmp_path / "o1.pt2", "--verify")
    assert r.returncode == 0 and "(ok, tolerance 0.0001)" in r.stdout, r.stdout
    # float16 rounds at about 1e-3: the default tolerance is eight of its steps, not 1e-4
    r = fxpure("apply", half, "-o", tmp_path / "o2.pt2", "--verify")
    assert r.returncode == 0 and "(ok, tolerance 0.0078125)" in r.stdout, r.stdout
    # quantized-conv named, nothing packed: the whole program is compared, not skipped
    r = fxpure("apply", numbers, "-o", tmp_path / "o3.pt2", "--verify", "--rules", "fuse-conv-bn,quantized-conv")
    assert r.returncode == 0 and "verify: max abs diff" in r.stdout, r.stdout


def test_explain_json_schema_round_trip(saved: dict[str, Path]) -> None:
    r = fxpure("explain", saved["resnext"], "--json", "--edge")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "fxpure.report/1" and doc["dialect"] == "edge"
    assert doc["rules"] == ["fuse-conv-bn", "split-group-conv"]
    assert doc["summary"]["fuse-conv-bn"] == {"planned": 6, "fallback": {}, "declined": {}}
    assert doc["summary"]["split-group-conv"]["planned"] == 2
    assert {c["outcome"] for c in doc["candidates"]} == {"will rewrite"}
    plan = doc["plans"][-1]
    assert plan["type"] == "RewritePlan" and plan["rule"] == "split-group-conv"
    slices = [c["expr"] for c in plan["constants"]]
    # slices of the fused float32 weights (batch-norm folded: w * rsqrt(var + eps), no cast: already float32)
    assert all(e["type"] == "Slice" and e["x"]["type"] == "Binary" and '"rsqrt"' in json.dumps(e) for e in slices)
    assert '"Cast"' not in json.dumps(slices)
    assert json.loads(json.dumps(doc)) == doc


def test_apply_verify_and_pte(saved: dict[str, Path], tmp_path: Path) -> None:
    out, pte = tmp_path / "out.pt2", tmp_path / "out.pte"
    r = fxpure("apply", saved["resnext"], "-o", out, "--verify", "--pte", pte)
    assert r.returncode == 0, r.stderr
    assert "8 rewrites applied" in r.stdout and "verify: max abs diff" in r.stdout and "(ok" in r.stdout
    program = torch.export.load(out)
    targets = {str(n.target) for n in program.graph.nodes}
    assert not any("batch_norm" in t for t in targets) and "aten.slice.Tensor" in targets
    assert pte.read_bytes()[4:8] == b"ET12"


def test_apply_json_and_verification_failure_exit_code(saved: dict[str, Path], tmp_path: Path) -> None:
    r = fxpure("apply", saved["resnext"], "-o", tmp_path / "o.pt2", "--verify", "--tolerance", "1e-12", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["verify"]["ok"] is False and doc["verify"]["max_rel"] > 1e-12
    assert doc["changed"] is True and len(doc["plans"]) == 8


def test_nothing_to_rewrite_is_not_an_error(saved: dict[str, Path], tmp_path: Path) -> None:
    r = fxpure("explain", saved["plain"])
    assert r.returncode == 0 and r.stdout.startswith("nothing to rewrite")
    r = fxpure("apply", saved["plain"], "-o", tmp_path / "same.pt2")
    assert r.returncode == 0 and "nothing to rewrite" in r.stdout and (tmp_path / "same.pt2").exists()
    r = fxpure("apply", saved["plain"], "-o", tmp_path / "same.pt2", "--verify")  # nothing to compare
    assert (
        r.returncode == 0 and r.stdout.splitlines()[-1] == "verify: whole program not compared (nothing was rewritten)"
    )


def _in_process(monkeypatch: pytest.MonkeyPatch, *args: str | Path) -> int:
    """``fxpure *args`` in this process (so a failure can be injected), its library set-up skipped."""
    monkeypatch.setattr(cli, "_quiet_libraries", lambda: None)
    return cli.main([str(a) for a in args])


def test_a_rewrite_that_cannot_be_applied_is_exit_3_and_writes_nothing(
    saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fails(*_: object) -> None:
        raise realize._ApplyError("apply-failed", "injected: the commit failed")

    monkeypatch.setattr(realize, "realize", fails)  # planning succeeds, applying the plans fails
    out, pte = tmp_path / "out.pt2", tmp_path / "out.pte"
    before = saved["resnext"].read_bytes()
    assert _in_process(monkeypatch, "apply", saved["resnext"], "-o", out, "--pte", pte, "--verify") == 3
    err = capsys.readouterr().err
    assert "injected: the commit failed" in err and err.rstrip().endswith("(program unchanged, nothing written)")
    assert list(tmp_path.iterdir()) == []  # no .pt2, no .pte, no temporary file
    assert saved["resnext"].read_bytes() == before


def test_ctrl_c_while_saving_is_one_line_exit_130_and_writes_nothing(
    saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(program: object, path: str, **_: object) -> None:
        Path(path).write_bytes(b"half an archive")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.export, "save", interrupted)
    out = tmp_path / "out.pt2"
    assert _in_process(monkeypatch, "apply", saved["resnext"], "-o", out) == 130
    assert capsys.readouterr().err == "fxpure: interrupted\n"  # no traceback
    assert list(tmp_path.iterdir()) == []


def test_a_failed_pte_lowering_is_exit_3_and_writes_no_pt2(
    saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fails(program: object, names: list[str]) -> bytes:
        raise RuntimeError("injected: the partitioner refused the program\nsecond line")

    monkeypatch.setattr(cli, "_lower", fails)
    out, pte = tmp_path / "out.pt2", tmp_path / "out.pte"
    assert _in_process(monkeypatch, "apply", saved["resnext"], "-o", out, "--pte", pte) == 3
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "fxpure: error: lowering to .pte failed (RuntimeError: injected: the partitioner refused the program);"
        " nothing written"
    )
    assert list(tmp_path.iterdir()) == []  # the .pt2 is saved only after lowering succeeded


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("explain", "{dir}/missing.pt2"), "no such file"),
        (("explain", "{dir}/model.onnx"), "not a .pt2 file"),
        (("explain", "{dir}/garbage.pt2"), "not a valid .pt2 archive"),
        (("explain", "{dir}/truncated.pt2"), "not a valid .pt2 archive"),
        (("explain", "{dir}/other.pt2"), "cannot load the program"),
        (("explain", "{dir}/edge.pt2"), "an edge-dialect program, which torch.export.load cannot read"),
        (("explain", "{dir}/resnext.pt2", "--rules", "fuse-conv-bn,bogus"), "unknown rule 'bogus'"),
        (("apply", "{dir}/garbage.pt2", "-o", "{dir}/x.pt2"), "not a valid .pt2 archive"),
        (("apply", "{dir}/plain.pt2", "-o", "{dir}/no/such/dir/x.pt2"), "cannot write"),
        (("apply", "{dir}/plain.pt2", "-o", "{dir}/x.pte"), "x.pte: not a .pt2 name"),
        (("apply", "{dir}/plain.pt2", "-o", "{dir}/x.pt2", "--pte", "{dir}/x.bin"), "x.bin: not a .pte name"),
        (("apply", "{dir}/plain.pt2", "-o", "{dir}/x.pt2", "--tolerance", "nan"), "--tolerance nan: not a positive"),
        (("apply", "{dir}/plain.pt2", "-o", "{dir}/x.pt2", "--tolerance", "-1"), "--tolerance -1: not a positive"),
        (("apply", "{dir}/plain.pt2", "-o", "{dir}/x.pt2", "--tolerance", "1e-3"), "--tolerance is the tolerance of"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(saved: dict[str, Path], args: tuple[str, ...], message: str) -> None:
    d = saved["resnext"].parent
    r = fxpure(*(a.format(dir=d) for a in args))
    assert r.returncode == 2
    assert r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("fxpure: error: ") and message in line
    assert "Traceback" not in r.stderr and "BadInput" not in line  # (one message, not wrapped in another)


def test_an_output_naming_a_symlink_loop_is_one_line_and_exit_2(saved: dict[str, Path], tmp_path: Path) -> None:
    # Path.resolve raises RuntimeError for a loop on Python 3.11: it was a traceback and exit 1
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for extra in (("-o", loop), ("-o", tmp_path / "x.pt2", "--pte", loop)):
        r = fxpure("apply", saved["resnext"], *extra)
        assert (r.returncode, r.stderr.splitlines()) == (
            2,
            [f"fxpure: error: {loop}: cannot write (Symlink loop from '{loop}')"],
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a pseudo-terminal")
def test_progress_shows_on_a_terminal(saved: dict[str, Path]) -> None:
    command = f"{FXPURE} explain {saved['declines']} --rules fuse-conv-bn"
    r = subprocess.run(
        ["script", "-qec", command, "/dev/null"], capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0
    assert "... loading" in r.stdout and "... planning" in r.stdout  # the pty merges stderr into stdout


def test_demo_runs_every_rule_end_to_end() -> None:
    r = fxpure("demo")
    assert r.returncode == 0, r.stdout + r.stderr
    # (each batch norm rule reports its own batch norms: the head's is fuse-linear-bn's, the tap's fuse-conv-bn's)
    assert "fuse-conv-bn: 7 to rewrite, 1 declined (1 conv-output-shared)" in r.stdout
    assert "fuse-linear-bn: 1 to rewrite, 0 declined" in r.stdout
    assert "split-group-conv: 1 to rewrite, 2 declined" in r.stdout
    assert "quantized-conv: 7 to rewrite, 1 declined (1 not-quantized)" in r.stdout  # the transposed conv
    vulkan = re.search(r"wrote (\S+fxpure-demo-vulkan\.pte) \(([\d,]+) bytes\)", r.stdout)
    assert vulkan is not None and Path(vulkan[1]).read_bytes()[4:8] == b"ET12"
    assert Path(vulkan[1]).stat().st_size == int(vulkan[2].replace(",", ""))
    assert r.stdout.rstrip().endswith("ok")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quantized") / "q.pt2"
    torch.export.save(pt2e(QOddDepthwise(), (torch.randn(1, 3, 8, 8),)), path)
    return path


@pytest.mark.parametrize("edge", [False, True])
def test_explain_quantized_conv(quantized: Path, edge: bool) -> None:
    r = fxpure("explain", quantized, "--rules", "quantized-conv", *(["--edge"] if edge else []))
    assert r.returncode == 0, r.stderr
    assert "et_vk" not in r.stderr
    want = "quantized-conv: 3 to rewrite (1 by fallback: 1 channel-alignment), 0 declined"
    assert r.stdout.splitlines()[-1] == want


def test_explain_node_says_a_fallback_and_the_reason_it_stands_in_for(quantized: Path) -> None:
    # found by a review: --node said "will rewrite" and listed the packing pattern's bindings, as if
    # the conv were packed; the table says it gets the float fallback (channel-alignment)
    lines = fxpure("explain", quantized, "--rules", "quantized-conv", "--node", "conv2d_1").stdout.splitlines()
    assert lines[:2] == [
        "quantized-conv at conv2d_1: will rewrite by fallback, instead of channel-alignment (pattern: conv)",
        "  conv2d_1: depthwise output channels is 6, not a multiple of 4",
    ]
    doc = json.loads(fxpure("explain", quantized, "--rules", "quantized-conv", "--node", "conv2d_1", "--json").stdout)
    ((attempt),) = doc["attempts"]
    assert attempt["reason"] is None and attempt["instead_of"]["code"] == "channel-alignment"


def test_explain_node_names_a_plan_that_drops_it_and_a_node_an_earlier_stage_made(
    quantized: Path, tmp_path: Path
) -> None:
    # found by a review: the activation's dequantize a packed conv drops, unread, was "considered by
    # no rule"; and a node only a stage's plan made was refused as no node of the program
    dq = fxpure("explain", quantized, "--rules", "quantized-conv", "--node", "dequantize_per_tensor")
    assert dq.stdout == "dequantize_per_tensor is part of quantized-conv's candidate at conv2d: will rewrite\n"
    assert fxpure("explain", quantized, "--rules", "quantized-conv", "--node", "nothing").returncode == 2
    # (a name of another form, or mistyped: the names it may mean, as the outside author wanted)
    near = fxpure("explain", quantized, "--rules", "quantized-conv", "--node", "conv")
    assert near.returncode == 2 and "no node 'conv' in the program (did you mean conv2d, conv2d_1" in near.stderr
    typo = fxpure("explain", quantized, "--rules", "quantized-conv", "--node", "conv2dd")
    assert "no node 'conv2dd' in the program (did you mean conv2d" in typo.stderr, typo.stderr
    path = tmp_path / "qlinear.pt2"
    torch.export.save(pt2e(torch.nn.Sequential(torch.nn.Linear(8, 8)), (torch.randn(2, 8),)), path)
    rules = ("--rules", "linear-to-conv2d,quantized-conv")
    made = fxpure("explain", path, *rules, "--node", "linear_conv_q")
    assert made.stdout == (
        "linear_conv_q is made by linear-to-conv2d's plan at linear\n"
        "linear_conv_q is part of quantized-conv's candidate at linear_conv: will rewrite\n"
    )
    # (a second review: one no later plan takes was still refused)
    kept = fxpure("explain", path, *rules, "--node", "linear_nchw_q")
    assert kept.stdout == "linear_nchw_q is made by linear-to-conv2d's plan at linear\n"
    doc = json.loads(fxpure("explain", path, *rules, "--node", "linear_nchw_q", "--json").stdout)
    assert [(p["rule"], p["anchor"]) for p in doc["made_by"]] == [("linear-to-conv2d", "linear")]
    assert doc["attempts"] == [] and doc["part_of"] == []


def test_apply_quantized_conv_writes_the_vulkan_pte(quantized: Path, tmp_path: Path) -> None:
    out, pte = tmp_path / "out.pt2", tmp_path / "out.pte"
    r = fxpure("apply", quantized, "--rules", "quantized-conv", "--verify", "-o", out, "--pte", pte)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"3 rewrites applied (1 by fallback), 0 candidates declined; wrote {out} and {pte}"
    checks = [line for line in lines if line.startswith("  plan quantized-conv at ")]
    assert len(checks) == 3
    assert sum("skipped (not checked: its et_vk kernels run in the Vulkan delegate" in c for c in checks) == 2
    assert sum(": ok (max rel diff 0)" in c for c in checks) == 1  # the fallback conv: exact
    assert "whole program not compared" in lines[-1] and lines[-1].endswith("; 1 plan above checked one by one")
    assert out.exists() and pte.read_bytes()[4:8] == b"ET12"  # an ExecuTorch program


class _Moded(torch.nn.Module):
    def forward(self, x: torch.Tensor, mode: str, k: int) -> torch.Tensor:
        return x * k if mode == "x" else x


def test_random_inputs_keep_the_values_export_kept() -> None:
    # a string input that happens to name a placeholder ("x") is the string, not the tensor
    ep = torch.export.export(_Moded(), (torch.randn(2, 3), "x", 3))
    x, mode, k = cli._random_inputs(ep, {})
    assert isinstance(x, torch.Tensor) and x.shape == (2, 3) and (mode, k) == ("x", 3)


class _Flat(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1])


class _Squeezed(torch.nn.Module):  # _Flat but at a batch of one: the batch dim goes too
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.squeeze()


def test_verify_runs_a_dynamic_size_at_its_least_value_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # found by an outside author: verify ran each symbolic size at 2 (or its least value if more)
    # only, and a rewrite wrong at the declared least value (1) was written
    batch = ({0: torch.export.Dim("B", min=1, max=16)},)
    x = (torch.randn(4, 3, 1, 1),)
    flat, squeezed = (torch.export.export(m, x, dynamic_shapes=batch) for m in (_Flat(), _Squeezed()))
    assert cli._verify(flat, squeezed, 1e-4) == {"max_abs": math.inf, "max_rel": math.inf, "ok": False}
    assert cli._verify(flat, copy.deepcopy(flat), 1e-4)["ok"]
    # a size the original itself does not run at (a kernel refusing a batch of one) is not compared
    outputs = cli._outputs

    def refusing(program: Any, inputs: tuple[Any, ...]) -> list[Any]:
        if "squeeze" not in program.graph_module.code and inputs[0].shape[0] == 1:  # the original
            raise RuntimeError("Expected more than 1 value per channel")
        return outputs(program, inputs)

    monkeypatch.setattr(cli, "_outputs", refusing)
    assert cli._verify(flat, squeezed, 1e-4) == {
        "max_abs": 0.0,
        "max_rel": 0.0,
        "ok": True,
        # said, not left out silently
        "not_compared": "at x.shape[0] = 1, where the original does not run "
        "(RuntimeError: Expected more than 1 value per channel)",
    }


OWN_RULE = """
from fxpure.families import CLONE
from fxpure.pattern import Bound, Op, Planner, Var, rule
from fxpure.snapshot import NodeRef


def _drop(p: Planner, c: Bound, x: NodeRef):
    return p.replace(c, x)


DROP_CLONE = rule("drop-clone", Op(CLONE, name="c", self=Var("x")), plan=_drop)


def make():
    return DROP_CLONE
"""


class _Clones(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.clone()) + x.clone().mul(2)


def test_a_rule_of_your_own_is_named_by_module_or_file(tmp_path: Path) -> None:
    (tmp_path / "myrules.py").write_text(OWN_RULE)
    program = tmp_path / "clones.pt2"
    torch.export.save(torch.export.export(_Clones(), (torch.randn(2, 3),)), program)
    # a file and its attribute: the rule itself, with a shipped one beside it
    r = fxpure("explain", program, "--rules", f"{tmp_path}/myrules.py:DROP_CLONE,fuse-conv-bn")
    assert r.returncode == 0, r.stderr
    summary = ["drop-clone: 2 to rewrite, 0 declined", "fuse-conv-bn: 0 to rewrite, 0 declined"]
    assert r.stdout.splitlines()[-2:] == summary
    # a module on the path and a function that makes the rule; applied, verified, lowered
    out, pte = tmp_path / "out.pt2", tmp_path / "out.pte"
    args = ["apply", program, "-o", out, "--rules", "myrules:make", "--verify", "--pte", pte, "--json"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([FXPURE, *map(str, args)], capture_output=True, text=True, timeout=300, check=False, env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["rules"] == ["drop-clone"] and doc["verify"]["ok"] and doc["written"]
    assert [c["outcome"] for c in doc["candidates"]] == ["will rewrite"] * 2
    rewritten = torch.export.load(out)
    assert not [n for n in rewritten.graph.nodes if "clone" in str(n.target)]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{dir}/none.py:RULE", "--rules {dir}/none.py:RULE: no file {dir}/none.py"),
        ("{dir}/broken.py:RULE", "--rules {dir}/broken.py:RULE: cannot import {dir}/broken.py (NameError: name"),
        ("{dir}/myrules.py:NOPE", "--rules {dir}/myrules.py:NOPE: {dir}/myrules.py has no attribute NOPE"),
        ("{dir}/myrules.py:CLONE", "--rules {dir}/myrules.py:CLONE: CLONE is not a rule"),
        ("json:dumps", "--rules json:dumps: dumps is not a rule (name, anchors, plan_at) nor makes one: calling"),
        # found by a hunt: an attribute of None was "no attribute", and what the maker raised was dropped
        ("{dir}/myrules.py:NONE", "--rules {dir}/myrules.py:NONE: NONE is not a rule"),
        (
            "{dir}/myrules.py:refusing",
            "--rules {dir}/myrules.py:refusing: refusing is not a rule (name, anchors,"
            " plan_at) nor makes one: calling it raised ValueError (groups must be 2 or more)",
        ),
        ("no_such_module_here:R", "--rules no_such_module_here:R: cannot import no_such_module_here (ModuleNotF"),
        ("fuse-conv-bn,", None),  # a trailing comma is no rule of its own
    ],
)
def test_a_rule_of_your_own_that_cannot_load_is_one_line_and_exit_2(
    saved: dict[str, Path], tmp_path: Path, entry: str, message: str | None
) -> None:
    refusing = "\n\nNONE = None\n\n\ndef refusing():\n    raise ValueError('groups must be 2 or more')\n"
    (tmp_path / "myrules.py").write_text(OWN_RULE + refusing)
    (tmp_path / "broken.py").write_text("RULE = undefined_name\n")
    r = fxpure("explain", saved["plain"], "--rules", entry.format(dir=tmp_path))
    if message is None:
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"fxpure: error: {message.format(dir=tmp_path)}"), line


def test_a_rule_file_loads_as_a_script_would_and_its_failures_are_one_line(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    files = {
        # prints when imported (stdout is the report), declares a dataclass under postponed
        # annotations (the module must be registered), imports the file beside it
        "loud.py": (
            "from __future__ import annotations\nfrom dataclasses import dataclass\nfrom beside import RULE\n"
            'print("loading my rules")\n\n\n@dataclass\nclass Options:\n    eps: float = 1e-5\n'
        ),
        "beside.py": OWN_RULE.replace("DROP_CLONE", "RULE"),
        "boom.py": OWN_RULE.replace("return p.replace(c, x)", "return 1 / 0"),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    r = fxpure("explain", saved["plain"], "--rules", f"{tmp_path}/loud.py:RULE", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rules"] == ["drop-clone"] and "loading my rules" in r.stderr
    program = tmp_path / "clones.pt2"
    torch.export.save(torch.export.export(_Clones(), (torch.randn(2, 3),)), program)
    r = fxpure("apply", program, "-o", tmp_path / "out.pt2", "--rules", f"{tmp_path}/boom.py:DROP_CLONE")
    (line,) = r.stderr.splitlines()
    assert r.returncode == 3 and "Traceback" not in r.stderr and not (tmp_path / "out.pt2").exists()
    assert line.startswith("fxpure: error: planning raised ZeroDivisionError: division by zero (at ")
    assert f"{tmp_path}/boom.py:" in line and line.endswith("(program unchanged, nothing written)")
    # two rules of one name would share their report lines
    r = fxpure("explain", saved["plain"], "--rules", f"fuse-conv-bn,{tmp_path}/beside.py:RULE,{tmp_path}/loud.py:RULE")
    assert r.returncode == 2
    expected = f"fxpure: error: --rules names two rules 'drop-clone' ({tmp_path}/loud.py:RULE is the second)"
    assert r.stderr.splitlines() == ["loading my rules", expected]


def test_an_archives_extra_files_are_written_again(saved: dict[str, Path], tmp_path: Path) -> None:
    program = tmp_path / "with_extra.pt2"
    ep = torch.export.load(saved["resnext"])
    # an extra file under models/ is no second program (the archive was refused: "holds 2 programs")
    files = {"tokenizer.json": '{"vocab": 42}', "models/config.json": "{}"}
    torch.export.save(ep, program, extra_files=files)
    out = tmp_path / "out.pt2"
    assert fxpure("apply", program, "-o", out).returncode == 0
    extra = dict.fromkeys(files, "")
    torch.export.load(out, extra_files=extra)
    assert extra == files
    # the archive's root folder is named after the file, as torch.export.save names it (it was the
    # temporary file's random name): the same program written twice is the same bytes
    with zipfile.ZipFile(out) as z:
        assert {n.split("/")[0] for n in z.namelist()} == {"out"}
    first = out.read_bytes()
    assert fxpure("apply", program, "-o", out).returncode == 0
    assert out.read_bytes() == first and sorted(p.name for p in tmp_path.iterdir()) == ["out.pt2", "with_extra.pt2"]
    # a member named just <archive>/extra (no file under it) is no extra file, and no traceback
    with zipfile.ZipFile(program) as z:
        top = z.namelist()[0].split("/")[0]
    with zipfile.ZipFile(program, "a") as z:
        z.writestr(f"{top}/extra", "x")
    r = fxpure("apply", program, "-o", out)
    assert (r.returncode, r.stderr) == (0, "")
    torch.export.load(out, extra_files=extra)
    assert extra == files


def test_an_archive_of_two_programs_or_a_corrupt_one_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    from torch.export.pt2_archive._package import package_pt2

    two, out = tmp_path / "two.pt2", tmp_path / "out.pt2"
    linear = torch.export.export(torch.nn.Linear(3, 3), (torch.randn(2, 3),))
    package_pt2(str(two), exported_programs={"model": torch.export.load(saved["resnext"]), "decoder": linear})
    # a flipped byte in a weight: the zip still opens, its checksum fails
    flipped = tmp_path / "flipped.pt2"
    with zipfile.ZipFile(saved["resnext"]) as z:
        info = next(i for i in z.infolist() if "/data/weights/weight_0" in i.filename)
    data = bytearray(saved["resnext"].read_bytes())
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + 5] ^= 0xFF
    flipped.write_bytes(bytes(data))
    for path, message in ((two, "holds 2 programs (decoder, model)"), (flipped, "corrupt archive")):
        r = fxpure("apply", path, "-o", out)
        assert r.returncode == 2 and not out.exists()
        (line,) = r.stderr.splitlines()
        assert line.startswith(f"fxpure: error: {path}: {message}"), line


CHATTY = (
    OWN_RULE
    + """

class Chatty:
    name = "chatty"

    def anchors(self, snap):
        print("anchors")  # on stdout, where the report goes
        return DROP_CLONE.anchors(snap)

    def plan_at(self, snap, node):
        return DROP_CLONE.plan_at(snap, node)


class Exits(Chatty):
    def plan_at(self, snap, node):
        raise SystemExit("bye")


class Unnamed(Chatty):
    @property
    def name(self):
        raise ValueError("no name yet")
"""
)


def test_a_rule_class_prints_and_sys_exit_are_handled(saved: dict[str, Path], tmp_path: Path) -> None:
    # a rule's prints go to stderr (--json stays JSON); a class of rules is made; sys.exit in a rule is
    # a rule that raised; a name that raises is no rule; a helper beside the rule named like a module of
    # the standard library shadows nothing torch imports
    (tmp_path / "chatty.py").write_text("import statistics\n" + CHATTY)
    (tmp_path / "statistics.py").write_text("raise ImportError('the rule folder shadowed the standard library')\n")
    program = tmp_path / "clones.pt2"
    torch.export.save(torch.export.export(_Clones(), (torch.randn(2, 3),)), program)
    rules = f"{tmp_path}/chatty.py"
    r = fxpure("explain", program, "--rules", f"{rules}:Chatty", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["rules"] == ["chatty"] and "anchors" in r.stderr, r.stderr
    r = fxpure("apply", program, "-o", tmp_path / "out.pt2", "--rules", f"{rules}:Exits")
    (line,) = r.stderr.splitlines()[-1:]
    assert r.returncode == 3 and line.startswith("fxpure: error: planning raised SystemExit: bye (at ")
    assert not (tmp_path / "out.pt2").exists()
    r = fxpure("explain", program, "--rules", f"{rules}:Unnamed")
    assert r.returncode == 2 and "Unnamed is not a rule" in r.stderr and "Traceback" not in r.stderr


class _Chunked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c2, self.bn = torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(self.c1(x), 2, dim=1)
        return self.bn(self.c2(a)) + b  # type: ignore[no-any-return]


def test_a_pte_the_lowering_capped_is_said(tmp_path: Path) -> None:
    # a conv reading a chunk of a dynamic batch: lowering a saved program of it narrows the batch
    # (rewritten or not: to 2 here), and the .pte refuses other batches
    batch = ({0: torch.export.Dim("batch", min=1, max=64)},)
    program = tmp_path / "chunked.pt2"
    model = randomize_bn(_Chunked()).eval()
    torch.export.save(torch.export.export(model, (torch.randn(2, 8, 10, 10),), dynamic_shapes=batch), program)
    args = ("apply", program, "-o", tmp_path / "o.pt2", "--pte", tmp_path / "o.pte", "--rules", "fuse-conv-bn")
    r = fxpure(*args)
    assert r.returncode == 0 and (tmp_path / "o.pte").exists(), r.stderr
    warned = r"^fxpure: warning: the \.pte takes \S+ up to \d+ only, where the program takes up to 64"
    assert re.search(warned, r.stderr), r.stderr
    from tests.test_dynamic_lowering import Mlp

    program = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(Mlp().eval(), (torch.randn(2, 10, 8),), dynamic_shapes=batch), program)
    r = fxpure(*args[:1], program, *args[2:-1], "linear-to-conv2d")  # nothing capped: nothing said
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


CUSTOM_OP = """
import torch

from fxpure.rules import fuse_conv_bn as rule  # (a rules file that also registers the op)


@torch.library.custom_op("fxpuretest::ident", mutates_args=())
def ident(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@ident.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(ident(self.conv(x)))
"""


def test_a_program_calling_an_operator_the_process_has_not_registered_says_which_and_loads_once_it_is(
    tmp_path: Path,
) -> None:
    (tmp_path / "myops.py").write_text(CUSTOM_OP)
    saved = tmp_path / "m.pt2"
    export = (
        "import torch, myops\n"
        f"torch.export.save(torch.export.export(myops.Model().eval(), (torch.randn(1, 3, 8, 8),)), {str(saved)!r})"
    )
    subprocess.run([sys.executable, "-c", export], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    r = fxpure("explain", saved)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"fxpure: error: {saved}: the program calls torch.ops.fxpuretest.ident.default, an operator this process "
        "has not registered: import the module that defines it (from a file given to --rules, say)"
    ), r.stderr
    r = fxpure("explain", saved, "--rules", f"{tmp_path / 'myops.py'}:rule")
    assert r.returncode == 0 and "producer-not-conv" in r.stdout, r.stderr


def test_a_program_calling_an_aten_operator_this_torch_does_not_have_says_so(tmp_path: Path) -> None:
    # found by a review: told to import the module defining torch.ops.aten.reluu (an archive another
    # torch version saved, or an edited one)
    saved, edited = tmp_path / "m.pt2", tmp_path / "edited.pt2"
    torch.export.save(torch.export.export(torch.nn.ReLU(), (torch.randn(2),)), saved)
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(edited, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("models/model.json"):
                data = data.replace(b"aten.relu.default", b"aten.reluu.default")
            dst.writestr(item.filename.replace("m/", "edited/", 1), data)
    r = fxpure("explain", edited)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"fxpure: error: {edited}: the program calls torch.ops.aten.reluu.default, which this torch "
        f"({torch.__version__}) does not have: export it with this version"
    ), r.stderr


class _Scales(torch.nn.Module):
    """A large output and a small one; ``flip`` negates the small one (wrong everywhere)."""

    def __init__(self, flip: bool) -> None:
        super().__init__()
        self.flip = flip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 1e6, (-x if self.flip else x) * 1e-3


def test_verify_measures_each_output_against_its_own_magnitude() -> None:
    # found by a hunt: one scale over all outputs, so a small output wrong in every element passed
    # (max_rel 2e-9) beside a large one; and complex outputs were compared on their real part only
    x = (torch.randn(4, 4),)
    right, wrong = (torch.export.export(_Scales(flip), x) for flip in (False, True))
    assert cli._verify(right, copy.deepcopy(right), 1e-4)["ok"]
    result = cli._verify(right, wrong, 1e-4)
    assert not result["ok"] and result["max_rel"] == pytest.approx(2.0)
    z = torch.tensor([1 + 1j, 2 - 3j])
    assert cli._diff(z.conj(), z) == 6.0 and cli._diff(z, z.clone()) == 0.0


class _Float8Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x * scale.float()


def test_verify_draws_a_float8_input_and_judges_what_the_program_computes_in() -> None:
    # found by a hunt: torch has no randn of float8 (a traceback out of --verify), and the float8
    # input, computed in float32 only, gave the whole program float8's tolerance (1.0)
    from adapters.validate import default_tolerance

    ep = torch.export.export(_Float8Scale(), (torch.randn(2, 3), torch.ones(3, dtype=torch.float8_e4m3fn)))
    x, scale = cli._random_inputs(ep, {})
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (3,) and x.dtype == torch.float32
    assert default_tolerance(ep) == 1e-4
    assert cli._verify(ep, copy.deepcopy(ep), default_tolerance(ep))["ok"]


def test_verify_of_a_program_whose_weights_are_on_the_meta_device_is_one_line_and_exit_3(tmp_path: Path) -> None:
    # found by a hunt: --verify copied the program first, which torch refuses for the meta tensors
    # torch.export.load gives back (a traceback, exit 1: "verification failed")
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    path, out = tmp_path / "meta.pt2", tmp_path / "out.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(1, 3, 8, 8, device="meta"),)), path)
    for verify in ((), ("--verify",)):
        r = fxpure("apply", path, "-o", out, "--rules", "fuse-conv-bn", *verify)
        assert r.returncode == 3 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("fxpure: error: meta-tensor: ")
        assert not out.exists()
    # nothing to rewrite: nothing to verify, no copy needed (a review found it refused, exit 2)
    r = fxpure("apply", path, "-o", out, "--rules", "split-group-conv", "--verify")
    assert (
        r.returncode == 0 and r.stdout.splitlines()[-1] == "verify: whole program not compared (nothing was rewritten)"
    )
    assert out.exists()
