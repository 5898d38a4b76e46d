"""The command line under what users do after a transform: buffers the program updates, dict and
NaN outputs, keyword inputs, long names, unwritable or clashing outputs, a packed program read back,
a failed check, a closed pipe. Each docstring says what went wrong before the fix the test holds
(found by an adversarial run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from adapters import cli
from adapters.validate import default_tolerance


def _main(monkeypatch: pytest.MonkeyPatch, *args: str | Path) -> int:
    """``fxpure *args`` in this process, its library set-up skipped (as tests/test_cli.py does)."""
    monkeypatch.setattr(cli, "_quiet_libraries", lambda: None)
    return cli.main([str(a) for a in args])


def _bn(bn: nn.BatchNorm2d) -> None:
    assert bn.running_mean is not None and bn.running_var is not None
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        _bn(self.bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.c(x))  # type: ignore[no-any-return]


def _save(model: nn.Module, path: Path, *args: object, **kwargs: object) -> Path:
    torch.export.save(torch.export.export(model.eval(), tuple(args), kwargs or None), path)
    return path


X = torch.randn(1, 3, 6, 6)


# --- wrong numbers -------------------------------------------------------------------------------


class _Counter(_ConvBN):
    """A buffer the program updates in place (a step counter; a training-mode BN's running stats
    behave the same way)."""

    n: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        return self.bn(self.c(x)) * self.n  # type: ignore[no-any-return]


def test_verify_runs_copies_so_a_buffer_the_program_updates_is_saved_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fxpure apply --verify` runs the rewritten program on random inputs and then saves it: a
    buffer the program mutates (counter, BN running stats) is saved with the verification run's
    update in it, so the written program computes different numbers from the original."""
    torch.manual_seed(0)
    model = _Counter().eval()
    src, out = _save(model, tmp_path / "counter.pt2", X), tmp_path / "out.pt2"
    assert _main(monkeypatch, "apply", src, "-o", out, "--verify") == 0
    with torch.no_grad():
        want = _Counter.forward(model, X)  # first call on the original: n == 1
    saved = torch.export.load(out)
    assert saved.state_dict["n"].item() == 0, "the saved counter was advanced by --verify"
    with torch.no_grad():
        got = saved.module()(X)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# --- verification that does not verify -----------------------------------------------------------


class _DictOut(_ConvBN):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"y": self.bn(self.c(x))}


def test_verify_compares_every_output_of_a_dict() -> None:
    """`--verify`'s whole-program comparison flattens one level only: a dict (or nested tuple)
    output is skipped, so two programs with different outputs are reported 'max abs diff 0, ok'."""
    torch.manual_seed(0)
    a = torch.export.export(_DictOut().eval(), (X,))
    torch.manual_seed(1)
    b = torch.export.export(_DictOut().eval(), (X,))  # other weights: other outputs
    with torch.no_grad():
        assert not torch.allclose(a.module()(X)["y"], b.module()(X)["y"])
    result = cli._verify(a, b, 1e-4)
    assert result["ok"] is False, result  # got {'max_abs': 0.0, 'max_rel': 0.0, 'ok': True}


class _Log(_ConvBN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.bn(self.c(x)))  # NaN wherever the BN output is negative


def test_verify_takes_nan_in_the_same_places_as_equal_and_writes_strict_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output with NaN at the same places before and after (log of a negative) makes
    `--verify` report 'max abs diff nan ... FAILED' (exit 1), and `--json` then prints `NaN`,
    which is not JSON."""
    torch.manual_seed(0)
    src, out = _save(_Log(), tmp_path / "log.pt2", X), tmp_path / "out.pt2"
    code = _main(monkeypatch, "apply", src, "-o", out, "--verify", "--json")
    text = capsys.readouterr().out

    def strict(c: str) -> float:
        raise ValueError(f"not JSON: {c}")

    doc = json.loads(text, parse_constant=strict)
    assert code == 0 and doc["verify"]["ok"] is True, doc["verify"]


class _KwOnly(_ConvBN):
    def forward(self, x: torch.Tensor, *, bias: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.bn(self.c(x)) + bias  # type: ignore[no-any-return]


def test_verify_calls_a_program_with_its_keyword_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`_random_inputs` passes every user input positionally: a program exported with a keyword
    input (or a list/dict input) cannot be called, so `--verify` always ends 'FAILED, the programs
    could not be compared' (exit 1) although the rewrite is correct."""
    torch.manual_seed(0)
    src = _save(_KwOnly(), tmp_path / "kw.pt2", X, bias=torch.randn(4, 1, 1))
    code = _main(monkeypatch, "apply", src, "-o", tmp_path / "out.pt2", "--verify")
    assert code == 0, capsys.readouterr().out


class _Asserting(_ConvBN):
    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n = k.item()
        torch._check(n == 0)  # type: ignore[no-untyped-call]
        return self.bn(self.c(x)) * (n + 2)  # type: ignore[no-any-return]


def test_verify_gives_one_answer_for_a_program_asserting_what_an_input_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`_random_inputs` drew `k` from 0 and 1 with the global generator: the original refused
    `k = 1` (its own assertion), and `--verify` of a correct rewrite ended 'FAILED' (exit 1) or
    passed, depending on the draw. (The first draw now gives `k = 1`: a later one is taken.)"""
    src = _save(_Asserting(), tmp_path / "k.pt2", X, torch.tensor(0))
    for seed in range(4):  # (the global generator no longer decides)
        torch.manual_seed(seed)
        code = _main(monkeypatch, "apply", src, "-o", tmp_path / "out.pt2", "--verify")
        out = capsys.readouterr().out
        assert code == 0 and "verify: max abs diff" in out and "(ok, tolerance" in out, out


class _Complex(_ConvBN):
    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.bn(self.c(x)) + torch.view_as_real(z).sum()  # type: ignore[no-any-return]


def test_verify_feeds_a_complex_input_complex_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`_random_inputs` drew `torch.randint` for every dtype that is not floating: on a complex input
    it raised, and `--verify` ended 'FAILED' (exit 1) with nothing written, the rewrite correct."""
    torch.manual_seed(0)
    src = _save(_Complex(), tmp_path / "c.pt2", X, torch.randn(3, dtype=torch.complex64))
    code = _main(monkeypatch, "apply", src, "-o", tmp_path / "out.pt2", "--verify")
    assert code == 0, capsys.readouterr().out
    assert (tmp_path / "out.pt2").exists()


def test_verify_keeps_one_copy_of_the_original_alive_while_it_draws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # each draw the original refused left its copy alive (cyclic garbage, and the error's frames):
    # eight copies of the program at once
    import weakref

    src = _save(_Asserting(), tmp_path / "k.pt2", X, torch.tensor(0))
    copies: list[weakref.ref[object]] = []

    def outputs(program: object, flat: tuple[object, ...]) -> list[object]:
        assert [c() for c in copies] == [None] * len(copies)  # every earlier copy freed
        copies.append(weakref.ref(program))
        raise RuntimeError("refused")

    monkeypatch.setattr(cli, "_outputs", outputs)
    assert _main(monkeypatch, "apply", src, "-o", tmp_path / "out.pt2", "--verify") == 1
    assert len(copies) == cli.DRAWS
    assert "could not be compared (RuntimeError: refused)" in capsys.readouterr().out


class _Overflowing(_ConvBN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.c(x)) * torch.inf  # type: ignore[no-any-return]


def test_verify_says_it_compared_nothing_where_the_original_returns_no_finite_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every output infinite (a float16 model overflowing, say): equal infinities compare equal, so
    `--verify` reported 'max abs diff 0 (ok)' of a comparison that checked nothing."""
    src = _save(_Overflowing(), tmp_path / "inf.pt2", X)
    assert _main(monkeypatch, "apply", src, "-o", tmp_path / "out.pt2", "--verify", "--json") == 0
    verify = json.loads(capsys.readouterr().out)["verify"]
    assert verify["not_compared"] == "where the original returns no finite value" and verify["ok"]


# --- tracebacks instead of one clean line -------------------------------------------------------


def test_apply_writes_to_a_long_valid_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`-o` with a legal 250-character file name: `_save` names its temporary file
    '.<name>.<12 hex>.tmp' (over NAME_MAX) before its try block, so the run ends in a raw
    OSError traceback (exit 1, 'verification failed') after all the work, and nothing is written."""
    torch.manual_seed(0)
    src = _save(_ConvBN(), tmp_path / "m.pt2", X)
    out = tmp_path / ("a" * 250 + ".pt2")  # 254 bytes: a valid name
    out.write_bytes(b"")  # the name is legal on this file system
    out.unlink()
    assert _main(monkeypatch, "apply", src, "-o", out) == 0
    assert out.read_bytes()[:2] == b"PK"


def test_an_overlong_path_is_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model path whose name exceeds NAME_MAX: `Path.is_dir()` raises ENAMETOOLONG inside
    `_check_path`, so the user gets a traceback (exit 1) instead of 'fxpure: error: ...' (exit 2)."""
    assert _main(monkeypatch, "explain", "/tmp/" + "b" * 300 + ".pt2") == 2


class _Branched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.cond(x.sum() > 0, lambda t: self.bn(self.c(t)), lambda t: t * 2, (x,))
        return out


def test_explain_node_takes_every_anchor_the_table_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table lists `true_graph_0.batch_norm` (`in-subgraph`); `--node` of it said 'no node ...
    in the program' (exit 2)."""
    src = _save(_Branched(), tmp_path / "cond.pt2", torch.randn(1, 3, 6, 6).abs())
    rules = ("--rules", "fuse-conv-bn")
    assert _main(monkeypatch, "explain", src, *rules) == 0
    assert "true_graph_0.batch_norm" in capsys.readouterr().out
    assert _main(monkeypatch, "explain", src, *rules, "--node", "true_graph_0.batch_norm") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "fuse-conv-bn at true_graph_0.batch_norm: declined: in-subgraph", lines
    assert "control-flow branch" in lines[1] and lines[2] == "  matched 0 pattern primitives; bound: nothing"
    assert _main(monkeypatch, "explain", src, *rules, "--node", "true_graph_0.batch_norm", "--json") == 0
    (attempt,) = json.loads(capsys.readouterr().out)["attempts"]
    assert (attempt["rule"], attempt["reason"]["code"]) == ("fuse-conv-bn", "in-subgraph")
    assert _main(monkeypatch, "explain", src, *rules, "--node", "true_graph_0.nothing") == 2


# --- outputs half-written, input overwritten ----------------------------------------------------


def test_a_pte_that_cannot_be_written_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--pte` naming a directory (or /dev/full, ...): the .pt2 is saved first, then writing the
    .pte fails with 'cannot write (Is a directory)', exit 2: one output written, the other not."""
    torch.manual_seed(0)
    src, out, pte = _save(_ConvBN(), tmp_path / "m.pt2", X), tmp_path / "out.pt2", tmp_path / "pte_dir"
    pte.mkdir()
    code = _main(monkeypatch, "apply", src, "-o", out, "--pte", pte)
    assert code != 0, capsys.readouterr()
    assert not out.exists(), "the .pt2 was written although the run failed"


def test_saving_that_runs_out_of_memory_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(found by a hunt) a MemoryError from torch.export.save escaped `fxpure apply` as a traceback."""
    torch.manual_seed(0)
    src, out = _save(_ConvBN(), tmp_path / "m.pt2", X), tmp_path / "out.pt2"

    def full(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(torch.export, "save", full)
    assert _main(monkeypatch, "apply", src, "-o", out) == 2
    assert capsys.readouterr().err == f"fxpure: error: {out}: cannot write (MemoryError)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt2"]


def test_a_pte_naming_the_input_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--pte` equal to the model (or to `-o`) is not refused: the input .pt2 is silently replaced
    by the .pte bytes (exit 0, 'wrote out.pt2 and m.pt2'); fxpure can no longer read it."""
    torch.manual_seed(0)
    src = _save(_ConvBN(), tmp_path / "m.pt2", X)
    before = src.read_bytes()
    code = _main(monkeypatch, "apply", src, "-o", tmp_path / "out.pt2", "--pte", src)
    assert src.read_bytes() == before, f"input overwritten (exit {code})"


# --- the CLI cannot read what it wrote ----------------------------------------------------------


def test_the_cli_reads_a_program_it_packed_with_quantized_conv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fxpure apply q.pt2 --rules quantized-conv -o packed.pt2` writes a program with et_vk ops;
    `fxpure explain/apply packed.pt2` then says 'cannot load the program (corrupt, or not saved by
    torch.export.save)', exit 2: `_load` never registers the et_vk ops (importing
    executorch.backends.vulkan.custom_ops_lib makes torch.export.load read it)."""
    import subprocess
    import sys

    from tests.quantized import pt2e

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))  # type: ignore[no-any-return]

    src, packed = tmp_path / "q.pt2", tmp_path / "packed.pt2"
    torch.export.save(pt2e(Two(), (torch.randn(1, 4, 8, 8),)), src)
    assert _main(monkeypatch, "apply", src, "--rules", "quantized-conv", "-o", packed) == 0
    assert "et_vk" in str(torch.export.load(packed).graph)  # this process has the et_vk ops registered
    fxpure = str(Path(sys.executable).with_name("fxpure"))  # a fresh process, as a user runs it
    r = subprocess.run(
        [fxpure, "explain", str(packed), "--rules", "quantized-conv"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr


def test_a_program_that_fails_verify_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--verify` does not gate the write: a run that ends 'verify: ... FAILED' (exit 1) has already
    saved the rewritten program, so `fxpure apply m.pt2 -o m.pt2 --verify` replaces the input with
    a program that failed its check."""
    torch.manual_seed(0)
    src = _save(_ConvBN(), tmp_path / "m.pt2", X)
    before = src.read_bytes()
    code = _main(monkeypatch, "apply", src, "-o", src, "--verify", "--tolerance", "1e-12")
    assert code == 1, capsys.readouterr().out  # verification failed (float rounding of the fold)
    assert src.read_bytes() == before, "a program that failed --verify replaced the input"


def test_output_into_a_closed_pipe_is_no_traceback(tmp_path: Path) -> None:
    """`fxpure explain m.pt2 | head -1` (a reader that stops early): the print raises
    BrokenPipeError and the user gets a Python traceback on stderr, exit 1."""
    import subprocess
    import sys

    torch.manual_seed(0)
    src = _save(_ConvBN(), tmp_path / "m.pt2", X)
    fxpure = str(Path(sys.executable).with_name("fxpure"))
    p = subprocess.Popen([fxpure, "explain", str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader has gone before anything is printed (as `| true`, or `| head` on long output)
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "Traceback" not in err, err


# --- dynamic sizes -------------------------------------------------------------------------------


class _Twice(nn.Module):
    """Two inputs, the second's batch twice the first's: a size derived from another."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _ConvBN()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.cat([x, x])) + y  # type: ignore[no-any-return]


@pytest.mark.parametrize("derived", [False, True])
def test_verify_feeds_sizes_without_an_upper_bound_or_derived_from_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, derived: bool
) -> None:
    """A dynamic dim declared without a max (``Dim("B")``: torch's int_oo, which says it is finite)
    raised a traceback through `--verify`'s per-plan check; a dim exported as ``2*B`` was given a
    size of its own, and the program's guard refused the inputs: verification failed, nothing written."""
    from torch.export import Dim

    batch = Dim("B")
    model: nn.Module = _Twice() if derived else _ConvBN()
    x = torch.randn(2, 3, 6, 6)
    args = (x, torch.randn(4, 4, 4, 4)) if derived else (x,)
    shapes = ({0: batch}, {0: 2 * batch}) if derived else ({0: batch},)
    src, out = tmp_path / "m.pt2", tmp_path / "o.pt2"
    torch.export.save(torch.export.export(model.eval(), args, dynamic_shapes=shapes), src)
    assert _main(monkeypatch, "apply", src, "-o", out, "--verify") == 0
    assert out.exists()


def test_the_default_tolerance_is_that_of_the_least_precise_dtype_the_program_computes_in() -> None:
    """A half-precision model whose output is cast to float32 rounds as float16 does: a tolerance
    read off the output alone (1e-4) failed `--verify` on its own rounding."""

    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3).half()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(x.half()).float()  # type: ignore[no-any-return]

    half = torch.export.export(Half().eval(), (X,))
    assert default_tolerance(half) == 8 * torch.finfo(torch.float16).eps
    assert default_tolerance(torch.export.export(_ConvBN().eval(), (X,))) == 1e-4


def test_a_pt2e_program_lowers_to_a_pte_without_a_delegate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # --pte lowers with the portable kernels: a PT2E program's quantize and dequantize had no out
    # variants there ("Missing out variants"), exit 3 and nothing written
    from tests.programs import run_pte
    from tests.quantized import pt2e

    program = pt2e(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), (X,))
    src, out, pte = tmp_path / "q.pt2", tmp_path / "o.pt2", tmp_path / "o.pte"
    torch.export.save(program, src)
    assert _main(monkeypatch, "apply", src, "-o", out, "--rules", "fuse-conv-bn", "--pte", pte) == 0
    (got,) = run_pte(pte.read_bytes(), (X,))
    assert torch.allclose(got, program.module()(X), atol=1e-5)
