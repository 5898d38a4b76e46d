"""The ``fxpure`` command line: ``fxpure demo``."""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from fxpure.reasons import Reason

T = TypeVar("T")


def _timed(label: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    out = fn()
    print(f"  {label:<34} {1e3 * (time.perf_counter() - t0):8.1f} ms")
    return out


def demo() -> int:
    """Export the embedded CNN, fold and split, check numerics, lower to .pte and run it; then
    quantize it, pack its int8 convs for Vulkan and write the Vulkan .pte."""
    warnings.filterwarnings("ignore")
    import torch
    from executorch.exir import to_edge
    from executorch.runtime import Runtime
    from returns.result import Failure

    from adapters.demo_model import demo_model
    from adapters.realize import transform
    from adapters.report import node_meta, table
    from fxpure.plan import Rule
    from fxpure.rules import fold_binary, fuse_conv_bn, fuse_linear_bn, split_group_conv

    def run_pte(buffer: bytes, x: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, float]:
        program = Runtime.get().load_program(buffer)  # (alive while its method runs)
        method = program.load_method("forward")
        assert method is not None
        method.execute(list(x))  # warm-up
        t0 = time.perf_counter()
        for _ in range(20):
            out = method.execute(list(x))[0]
        return out, (time.perf_counter() - t0) / 20 * 1e3

    print(
        "fxpure demo: batch-norm and constant folding, grouped-conv splitting, int8 Vulkan packing on an embedded CNN"
    )
    model, x = demo_model()
    with torch.no_grad():
        want = model(*x)
    exported = _timed("torch.export", lambda: torch.export.export(model, x))
    plain = _timed("to_edge (unfused copy)", lambda: to_edge(copy.deepcopy(exported)))
    edge = _timed("to_edge", lambda: to_edge(exported))
    program = edge.exported_program()
    rules: list[Rule] = [fuse_conv_bn(), fuse_linear_bn(), fold_binary(), split_group_conv()]
    metas = node_meta(program.graph_module)
    result = _timed("fxpure transform (plan + apply)", lambda: transform(program, rules))
    if isinstance(result, Failure):
        print(f"error: {result.failure()}", file=sys.stderr)
        return 1
    report = result.unwrap().report
    print()
    print(table(report, metas, [r.name for r in rules]))
    with torch.no_grad():
        got = program.module()(*x)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"\n  numerics vs eager: max relative error {rel:.2e}")
    plain_pte = _timed("lower unfused program to .pte", lambda: plain.to_executorch().buffer)
    fused_pte = _timed("lower fused program to .pte", lambda: edge.to_executorch().buffer)
    _, ms_before = run_pte(plain_pte, x)
    out_after, ms_after = run_pte(fused_pte, x)
    rt_rel = ((out_after - want).abs().max() / want.abs().max()).item()
    print(f"  ExecuTorch runtime vs eager: max relative error {rt_rel:.2e}")
    print(f"\n  {'':<12} {'.pte bytes':>12} {'runtime ms':>11}")
    print(f"  {'before':<12} {len(plain_pte):>12,} {ms_before:>11.3f}")
    print(f"  {'after':<12} {len(fused_pte):>12,} {ms_after:>11.3f}")
    ok = rel < 1e-4 and rt_rel < 1e-4
    quantized_ok = _demo_quantized(model, x)
    print("\nok" if ok and quantized_ok else "\nFAILED", flush=True)
    return 0 if ok and quantized_ok else 1


def _demo_quantized(model: Any, x: tuple[Any, ...]) -> bool:
    """PT2E-quantize the demo model, pack its int8 convs for Vulkan, write the Vulkan .pte."""
    import logging
    import tempfile
    from pathlib import Path

    import torch
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from executorch.exir import to_edge
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from adapters.passes import QuantizedConvolutionPass
    from adapters.realize import transform
    from adapters.report import node_meta, table
    from fxpure.rules import fuse_conv_bn

    print("\nquantized: PT2E int8 (XNNPACKQuantizer, per channel), convs packed for the Vulkan q8ta kernels")
    print("  (batch norms fused by fxpure first: prepare_pt2e's own fold crashes on the grouped ConvTranspose)")

    def quantize() -> Any:
        gm = torch.export.export(model, x).module()
        transform(gm, [fuse_conv_bn()]).unwrap()
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
        prepared = prepare_pt2e(gm, quantizer)
        prepared(*x)
        return to_edge(torch.export.export(convert_pt2e(prepared), x))

    edge = _timed("PT2E quantize + to_edge", quantize)
    metas = node_meta(edge.exported_program().graph_module)
    packing = QuantizedConvolutionPass()
    edge = _timed("fxpure QuantizedConvolutionPass", lambda: edge.transform([packing]))
    assert packing.last is not None
    print()
    print(table(packing.last.report, metas, ["quantized-conv"]))
    logging.disable(logging.INFO)  # the partitioner reports its progress on the root logger
    try:
        buffer = _timed(
            "lower through VulkanPartitioner", lambda: edge.to_backend(VulkanPartitioner()).to_executorch().buffer
        )
    finally:
        logging.disable(logging.NOTSET)
    path = Path(tempfile.gettempdir()) / "fxpure-demo-vulkan.pte"
    path.write_bytes(buffer)
    print(f"  wrote {path} ({len(buffer):,} bytes)")
    return len(buffer) > 0


def _quiet_libraries() -> None:
    """Library chatter (optional kernels not found, deprecations, loader tracebacks) stays off stderr."""
    import contextlib
    import io
    import logging

    warnings.filterwarnings("ignore")
    with contextlib.redirect_stderr(io.StringIO()):
        import executorch.exir  # noqa: F401  (imports torch and torchao: their import-time warnings)
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in ("torch", "torchao", "executorch"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class BadInput(Exception):
    """A user error: reported as one line, exit code 2."""


EXIT_OK, EXIT_VERIFY_FAILED, EXIT_BAD_INPUT, EXIT_REWRITE_FAILED = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def _first_line(e: BaseException) -> str:
    """The first line of what ``e`` says ("" if nothing)."""
    return (str(e).strip().splitlines() or [""])[0]


class Progress:
    """Step messages on stderr when it is a terminal; silent when piped."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"... {message}", file=sys.stderr, flush=True)


def _rules(spec: str) -> list[tuple[str, Any]]:
    """The rules ``--rules`` names, each with its name: a shipped rule's name, or your own as
    ``module:attribute`` or ``path/to/file.py:attribute`` (a rule, or a function that makes one)."""
    from fxpure.rules import RULES

    entries = [r.strip() for r in spec.split(",") if r.strip()]
    if not entries:
        raise BadInput(f"no rule in --rules {spec!r} (available: {', '.join(RULES)}, or module:attribute)")
    out: list[tuple[str, Any]] = []
    for entry in entries:
        if ":" in entry:
            rule = _own_rule(entry)
            out.append((str(rule.name), rule))
        elif entry in RULES:
            out.append((entry, RULES[entry]()))
        else:
            raise BadInput(f"unknown rule {entry!r} (available: {', '.join(RULES)}, or module:attribute)")
        if [n for n, _ in out].count(out[-1][0]) > 1:  # a report names a rule's candidates by its name
            raise BadInput(f"--rules names two rules {out[-1][0]!r} ({entry} is the second)")
    return out


def _own_rule(entry: str) -> Any:
    """A rule of the user's own: ``module:attribute`` or ``file.py:attribute``."""
    import importlib
    import importlib.util
    import zlib
    from pathlib import Path

    where, _, attr = entry.rpartition(":")
    _quiet_libraries()  # torch and executorch first: a file beside the rule shadows none of their modules
    try:  # what the module prints goes to stderr: stdout is the report (``--json``)
        with contextlib.redirect_stdout(sys.stderr):
            if where.endswith(".py"):
                path = Path(where).resolve()
                # as if run from its folder: it imports the files beside it (a module of one name
                # is imported once: two folders' helpers.py are one); registered under a name of
                # its own (a dataclass looks its module up), which shadows no module
                name = f"fxpure_rules_{path.stem}_{zlib.crc32(str(path).encode()):08x}"  # one per file
                spec = importlib.util.spec_from_file_location(name, path)
                if not path.is_file() or spec is None or spec.loader is None:
                    raise BadInput(f"--rules {entry}: no file {where}")
                sys.path.insert(0, str(path.parent))
                try:
                    module = sys.modules[name] = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                finally:  # the folder shadows no module imported later (the standard library's)
                    sys.path.remove(str(path.parent))
            else:
                module = importlib.import_module(where)
    except BadInput:
        raise
    except (Exception, SystemExit) as e:  # the user's module does not import: say so in one line
        first = _first_line(e)
        raise BadInput(f"--rules {entry}: cannot import {where} ({type(e).__name__}: {first})") from e
    if not hasattr(module, attr):
        raise BadInput(f"--rules {entry}: {where} has no attribute {attr}")
    found = getattr(module, attr)
    rule, why = found, ""
    if not _is_rule(found) and callable(found):
        try:
            with contextlib.redirect_stdout(sys.stderr):
                rule = found()
        except (Exception, SystemExit) as e:  # not a maker of rules after all: say what calling it did
            first = _first_line(e)
            rule, why = None, f": calling it raised {type(e).__name__}" + (f" ({first})" if first else "")
    if not _is_rule(rule):
        raise BadInput(f"--rules {entry}: {attr} is not a rule (name, anchors, plan_at) nor makes one{why}")
    return rule


class RuleRaised(Exception):
    """Planning raised (a bug in a rule, say): nothing was applied."""


def _planned(run: Callable[[], T]) -> T:
    """``run()``; an exception a rule raised while planning (nothing is applied then) as one line
    that says where (``transform`` rolls back any failure of its own)."""
    import traceback

    try:  # what a rule prints goes to stderr: stdout is the report (``--json``)
        with contextlib.redirect_stdout(sys.stderr):
            return run()
    except (Exception, SystemExit) as e:  # a rule's sys.exit() is a rule that raised
        frame = traceback.extract_tb(e.__traceback__)[-1]
        first = _first_line(e)
        raise RuleRaised(f"{type(e).__name__}: {first} (at {frame.filename}:{frame.lineno})") from e


def _is_rule(obj: Any) -> bool:
    """A rule object (a class of rules is a maker of one, called)."""
    try:
        name = getattr(obj, "name", None)
    except Exception:  # a name property that raises: no rule
        return False
    return (
        not isinstance(obj, type)
        and isinstance(name, str)
        and all(callable(getattr(obj, a, None)) for a in ("anchors", "plan_at"))
    )


# float rewrites; quantized-conv is asked for by name (it applies to PT2E-quantized programs only)
DEFAULT_RULES = "fuse-conv-bn,split-group-conv"
# rules whose new ops run only inside a backend delegate: --pte lowers through that partitioner, and
# --verify cannot run the whole program on the host (each plan is still checked where it can be)
DELEGATED = {"quantized-conv": "vulkan"}


def _check_path(path: str) -> None:
    """Cheap checks, before torch is imported: the file exists and is a .pt2 (zip) archive."""
    import zipfile
    from pathlib import Path

    p = Path(path)
    try:
        if p.is_dir():
            raise BadInput(f"{path}: is a directory, not a .pt2 file")
        if not p.is_file():
            raise BadInput(f"{path}: no such file")
        if p.suffix != ".pt2":
            raise BadInput(f"{path}: not a .pt2 file (expected a program saved with torch.export.save)")
        if not zipfile.is_zipfile(p):
            raise BadInput(f"{path}: not a valid .pt2 archive (corrupt or truncated)")
        with zipfile.ZipFile(p) as z:
            bad = z.testzip()  # every member read once: a flipped byte would be saved as the program
            models = sorted(n.rpartition("/")[2].removesuffix(".json") for n in z.namelist() if _is_model(n))
    except BadInput:
        raise
    except OSError as e:  # a name too long for the file system, say
        raise BadInput(f"{path}: cannot read ({e.strerror or e})") from e
    except Exception as e:  # the zip reader's own errors (a bad header, a bad compressed stream)
        raise BadInput(f"{path}: not a valid .pt2 archive ({type(e).__name__}: {e})") from e
    if bad is not None:
        raise BadInput(f"{path}: corrupt archive ({bad} fails its checksum)")
    if len(models) > 1:  # apply would write back one of them
        raise BadInput(f"{path}: holds {len(models)} programs ({', '.join(models)}); fxpure takes an archive of one")


def _is_model(member: str) -> bool:
    """``member`` of a .pt2 archive is a program's ``<root>/models/<name>.json`` (an extra file the
    archive carries, ``<root>/extra/models/config.json`` say, is none)."""
    parts = member.split("/")
    return len(parts) == 3 and parts[1] == "models" and parts[2].endswith(".json")


def _check_writable(model: str, output: str, pte: str | None) -> None:
    """Every output goes into an existing, writable directory, and the .pte is neither the input
    nor the .pt2 written (one would overwrite the other)."""
    import os
    from pathlib import Path

    for path, suffix in ((output, ".pt2"), (pte, ".pte")):
        if path is None:
            continue
        try:
            target = Path(path).resolve()
            parent = target.parent
            writable = parent.is_dir() and os.access(parent, os.W_OK)
            if writable and target.is_dir():
                raise BadInput(f"{path}: cannot write (is a directory)")
        except OSError as e:  # a name too long for the file system, say
            raise BadInput(f"{path}: cannot write ({e.strerror or e})") from e
        except RuntimeError as e:  # a symlink loop (Path.resolve on Python 3.11)
            raise BadInput(f"{path}: cannot write ({e})") from e
        if not writable:
            raise BadInput(f"{path}: cannot write (no writable directory {parent})")
        if target.suffix != suffix:  # (a .pt2 archive written as x.pte would be refused as input)
            raise BadInput(f"{path}: not a {suffix} name (it is written as a {suffix} file)")
    if pte is not None:
        named = {Path(model).resolve(): "input", Path(output).resolve(): "output"}.get(Path(pte).resolve())
        if named is not None:
            raise BadInput(f"--pte {pte}: names the {named} .pt2")


def _load(path: str, extra_files: dict[str, Any] | None = None) -> Any:
    """A program saved with ``torch.export.save`` (``main`` ran ``_check_path`` on it already),
    read by ``torch.export.load``; ``extra_files`` is filled with the archive's extra files."""
    import importlib
    import zipfile

    import torch

    from adapters.torchnames import OP_LIBRARIES

    if extra_files is not None:  # the loader fills the names it is given (and only a non-empty dict)
        with zipfile.ZipFile(path) as z:
            parts = [n.split("/", 2) for n in z.namelist()]  # <archive>/extra/<name>
            extra_files.update((p[2], "") for p in parts if len(p) == 3 and p[1] == "extra" and p[2])
    with contextlib.suppress(Exception):
        return torch.export.load(path, extra_files=extra_files)
    try:  # a program quantized-conv packed calls the et_vk ops, which this import registers
        importlib.import_module(OP_LIBRARIES["et_vk"])
        return torch.export.load(path, extra_files=extra_files)
    except Exception as e:  # any failure inside the loader means the archive is unusable
        if _edge_archive(path):
            raise BadInput(
                f"{path}: an edge-dialect program, which torch.export.load cannot read: save the aten "
                "program (before to_edge) and give that"
            ) from e
        unknown = _unknown_ops(path)
        torch_own = [op for op in unknown if op.split(".")[2] in ("aten", "prims")]
        if torch_own:  # torch's own: another torch version's program (or an edited one)
            raise BadInput(
                f"{path}: the program calls {', '.join(torch_own)}, which this torch ({torch.__version__}) "
                "does not have: export it with this version"
            ) from e
        if unknown:
            raise BadInput(
                f"{path}: the program calls {', '.join(unknown)}, an operator this process has not "
                "registered: import the module that defines it (from a file given to --rules, say)"
            ) from e
        raise BadInput(f"{path}: cannot load the program (corrupt, or not saved by torch.export.save)") from e


def _unknown_ops(path: str) -> list[str]:
    """The ``torch.ops`` operators the archive's graphs call that this process has not registered (a
    custom op's library not imported), in order."""
    import re
    import zipfile

    import torch

    found: dict[str, None] = {}
    with contextlib.suppress(Exception), zipfile.ZipFile(path) as z:
        for n in z.namelist():
            if n.endswith(".json") and "/models/" in n:
                found.update(dict.fromkeys(re.findall(r'"target": "torch\.ops\.(\w+\.\w+\.\w+)"', z.read(n).decode())))
    unknown = []
    for name in found:
        namespace, op, overload = name.split(".")
        try:
            getattr(getattr(getattr(torch.ops, namespace), op), overload)
        except (AttributeError, RuntimeError):
            unknown.append(f"torch.ops.{name}")
    return unknown


def _edge_archive(path: str) -> bool:
    """Whether the archive's graph calls edge-dialect ops (saved from ``to_edge``'s program)."""
    import zipfile

    with contextlib.suppress(Exception), zipfile.ZipFile(path) as z:
        return any(
            n.endswith("models/model.json") and b'"target": "executorch.exir.dialects.edge.' in z.read(n)
            for n in z.namelist()
        )
    return False


def _random_inputs(program: Any, symbols: Mapping[str, int], seed: int = 0) -> tuple[Any, ...]:
    """Random tensors of the shapes and dtypes the program's user inputs were exported with, in
    input order, drawn from ``seed`` (the same every run); a symbolic size takes its value in
    ``symbols`` for all inputs (:func:`adapters.validate.symbol_values`)."""
    import torch
    from torch.export.graph_signature import ConstantArgument, InputKind

    from adapters.validate import size_value

    def size(d: Any) -> int:
        return d if isinstance(d, int) else size_value(str(d.node.expr), symbols)

    placeholders = {n.name: n for n in program.graph.find_nodes(op="placeholder")}
    draw = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        arg = spec.arg  # a value export kept as it was (a number, a string), or a placeholder
        val = arg.value if isinstance(arg, ConstantArgument) else placeholders[arg.name].meta["val"]
        if not isinstance(val, torch.Tensor):
            out.append(size(val) if isinstance(val, torch.SymInt) else val)
            continue
        shape = [size(d) for d in val.shape]
        if val.dtype.is_floating_point or val.dtype.is_complex:
            try:
                out.append(torch.randn(shape, dtype=val.dtype, generator=draw))
            except (NotImplementedError, RuntimeError):  # no such kernel (float8): drawn as float32, cast
                out.append(torch.randn(shape, generator=draw).to(val.dtype))
        else:
            out.append(torch.randint(0, 2, shape, dtype=val.dtype, generator=draw))
    return tuple(out)


def _save(writes: Sequence[tuple[str, Callable[[str], object]]]) -> None:
    """Write every file, all or none: each ``write`` fills a temporary file in its path's directory,
    and each is renamed over its path only once all are complete (so ``-o`` may name the input itself;
    a failed write leaves every file as it was). A symlink is written through (the file it names is
    replaced, with its mode); anything else that is not a regular file is refused. A new file takes
    the mode the umask gives."""
    import os
    import secrets
    import stat
    from pathlib import Path

    made: list[tuple[str, Path]] = []
    path = ""
    try:
        for path, write in writes:
            target = Path(path).resolve()
            if target.exists() and not target.is_file():
                raise BadInput(f"{path}: not a regular file")
            mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
            # the file under its own name, in a new directory beside it: torch.export.save names the
            # archive's root folder after the file (the same program saved twice is the same bytes)
            folder = target.parent / f".fxpure-{secrets.token_hex(6)}.tmp"  # short: any valid name fits
            folder.mkdir()
            tmp = str(folder / target.name)
            made.append((tmp, target))
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies
            write(tmp)
            if mode is not None:
                os.chmod(tmp, mode)
        for tmp, target in made:
            os.replace(tmp, target)
            os.rmdir(Path(tmp).parent)
    except BaseException as e:
        for tmp, _ in made:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with contextlib.suppress(OSError):
                os.rmdir(Path(tmp).parent)
        if isinstance(e, Exception) and not isinstance(e, BadInput):  # (a full disk, torch failing, no memory)
            raise BadInput(
                f"{path}: cannot write ({getattr(e, 'strerror', None) or str(e) or type(e).__name__})"
            ) from e
        raise


def _outputs(program: Any, flat: tuple[Any, ...]) -> list[Any]:
    """Every value a run of ``program`` returns (through dicts and nested tuples), on a copy of
    ``flat`` (user inputs in order: a program may write into an input) put back in the call's own
    structure (keywords, lists, dicts)."""
    import torch
    from torch.utils._pytree import tree_leaves, tree_unflatten

    args, kwargs = tree_unflatten(list(copy.deepcopy(flat)), program.call_spec.in_spec)
    with torch.no_grad():
        return list(tree_leaves(program.module()(*args, **kwargs)))


def _diff(got: Any, want: Any) -> float:
    """The largest difference of two outputs: 0 where both hold the same value (inf, or NaN in both),
    inf where they differ in shape, in kind, or in where a NaN is."""
    import torch

    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return 0.0 if type(got) is type(want) and got == want else float("inf")
    if got.shape != want.shape or got.is_complex() != want.is_complex():
        return float("inf")
    g, w = _real(got), _real(want)
    d = torch.where((g == w) | (g.isnan() & w.isnan()), 0.0, (g - w).abs())
    return d.nan_to_num(nan=float("inf")).max().item() if d.numel() else 0.0


def _real(t: Any) -> Any:
    """A tensor as float64 numbers, a complex one as its real and imaginary parts (a last dim of 2)."""
    import torch

    return torch.view_as_real(t.resolve_conj()).double() if t.is_complex() else t.double()


def _scale(want: Any) -> float:
    """What an output's difference is relative to: its largest finite magnitude (1 for none, or 0)."""
    import torch

    if not isinstance(want, torch.Tensor) or not want.numel():
        return 1.0
    finite = _real(want).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return finite.abs().max().item() or 1.0


def _verify(original: Any, program: Any, tolerance: float) -> dict[str, Any]:
    """Both programs on the same random inputs, the first of :data:`DRAWS` seeded draws the original
    runs on (the same every time): max abs / rel difference, or the error that stopped it.
    A program of symbolic sizes runs with each at its declared least value, but at least 2, and
    again with each at 1 where its declared least value is 1 or less (a squeeze of a batch of one;
    0 is not tried); that second run is skipped where the original itself does not run, and the
    result says so (``not_compared``), as it says where every value the original returns is NaN or
    infinite (which compares equal to NaN or the same infinity)."""
    import torch

    from adapters.validate import symbol_values

    least = [symbol_values(program), symbol_values(program, least=1)]
    runs = least[:1] if least[1] == least[0] else least
    out: dict[str, Any] = {"max_abs": 0.0, "max_rel": 0.0, "ok": True}
    skipped: list[str] = []
    for i, symbols in enumerate(runs):
        sizes = ", ".join(f"{_dim_of(program, k)} = {v}" for k, v in symbols.items() if v != runs[0].get(k))
        drawn = _drawn(original, program, symbols)
        if isinstance(drawn, str):  # the original runs on no draw at these sizes: exit 1 (the first sizes)
            if i:
                skipped.append(f"at {sizes}, where the original does not run ({drawn})")
                continue
            return {"ok": False, "error": drawn}
        x, want = drawn
        tensors = [w for w in want if isinstance(w, torch.Tensor) and w.numel()]
        if tensors and not any(w.isfinite().any().item() for w in tensors):  # (equal NaNs and infinities: no check)
            skipped.append(f"{'at ' + sizes + ', ' if i else ''}where the original returns no finite value")
        try:
            got = _outputs(copy.deepcopy(program), x)
        except Exception as e:
            return {"ok": False, "error": _line(e)}
        if len(got) != len(want):
            return {"ok": False, "error": f"the programs return {len(want)} and {len(got)} values"}
        # each output against its own magnitude: a small one is not measured against a large one
        diffs = [(d, d / _scale(w)) for g, w in zip(got, want, strict=True) for d in [_diff(g, w)]]
        abs_err, rel_err = max((d for d, _ in diffs), default=0.0), max((r for _, r in diffs), default=0.0)
        if rel_err >= out["max_rel"]:
            out = {"max_abs": abs_err, "max_rel": rel_err, "ok": rel_err <= tolerance}
    return {**out, "not_compared": "; ".join(skipped)} if skipped else out


DRAWS = 8
"""Inputs ``--verify`` draws (seeds 0, 1, ...) until the original runs on one: a program may assert
what its inputs hold (``k.item() >= 1``)."""


def _drawn(original: Any, program: Any, symbols: Mapping[str, int]) -> tuple[tuple[Any, ...], list[Any]] | str:
    """The first draw of inputs the original runs on, and its outputs; else the first draw's error,
    in one line. Each run is of a copy (a run may update buffers in place, or stop half way); a
    copy that failed is freed before the next (one copy of the program alive at a time)."""
    import gc

    first = ""
    for seed in range(DRAWS):
        x, model = _random_inputs(program, symbols, seed), copy.deepcopy(original)
        try:
            return x, _outputs(model, x)
        except Exception as e:
            first = first or _line(e)
        del model
        gc.collect()  # (the copy, and the frames of the error that still read it, are cyclic garbage)
    return first


def _dim_of(program: Any, symbol: str) -> str:
    """Where a symbolic size is an input's: ``x.shape[0]`` (else the symbol's own name)."""
    for node in program.graph.find_nodes(op="placeholder"):
        shape = getattr(node.meta.get("val"), "shape", ())
        at = next((i for i, d in enumerate(shape) if str(d) == symbol), None)
        if at is not None and node.name in program.graph_signature.user_inputs:
            return f"{node.name}.shape[{at}]"
    return symbol


def _line(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def _json(doc: Any) -> str:
    """``doc`` as strict JSON: a difference that is not finite is written as a string ("inf")."""
    import json
    import math

    def plain(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    return json.dumps(plain(doc), indent=2, allow_nan=False)


def _flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def explain(args: argparse.Namespace) -> int:
    """Plan the chosen rules on a saved program and report every candidate; changes nothing."""
    from executorch.exir import to_edge
    from returns.result import Failure

    from adapters.realize import transform
    from adapters.report import node_meta, table, to_json

    names, rules = [n for n, _ in args.loaded], [r for _, r in args.loaded]
    progress = Progress()
    progress(f"loading {args.model}")
    program = _load(args.model)
    if args.edge:
        progress("lowering to edge")
        try:
            program = to_edge(program).exported_program()
        except Exception as e:  # executorch refuses the program: say so in one line (a lowering failed: 3)
            first = _first_line(e)
            print(f"fxpure: error: to_edge cannot lower {args.model} ({type(e).__name__}: {first})", file=sys.stderr)
            return EXIT_REWRITE_FAILED
    progress("planning")
    result = _planned(lambda: transform(program, rules, dry_run=True))
    if isinstance(result, Failure):  # a program fxpure cannot read is bad input; the rest, as apply says
        print(f"fxpure: error: {result.failure()}", file=sys.stderr)
        unreadable = result.failure().code in ("unsupported-program", "meta-tensor")
        return EXIT_BAD_INPUT if unreadable else EXIT_REWRITE_FAILED
    report = result.unwrap().report
    if args.node is not None:
        return _explain_node(report, rules, args.node, args.json)
    if args.json:
        print(
            _json(
                to_json(
                    report, node_meta(program.graph_module), names, program=args.model, dialect=report.before.dialect
                )
            )
        )
        return EXIT_OK
    if not report.plans and not report.rejections:
        print(f"nothing to rewrite: no candidates for {', '.join(names)}")
    print(table(report, node_meta(program.graph_module), names))
    return EXIT_OK


def _near(node: str, snap: Any) -> str:
    """The names of ``snap``'s nodes a mistyped or other form's name may mean, as a hint: those it
    is part of (an edge program's ``aten_add_tensor`` for ``add``), else close spellings."""
    names = [n.name for n in snap.nodes if n.op != "output"]
    near = [n for n in names if node in n] or difflib.get_close_matches(node, names, n=3, cutoff=0.6)
    shown = ", ".join(near[:3]) + (", ..." if len(near) > 3 else "")
    return f" (did you mean {shown}?)" if near else ""


def _explain_node(report: Any, rules: list[Any], node: str, as_json: bool) -> int:
    """How far each rule got at one node: its reason (code, pattern path, message), the bindings
    it had made, and how many pattern primitives matched; and the candidates of other nodes it is
    part of (a conv a batch norm's fusion takes, or whose other reader declined it)."""

    from fxpure.pattern import attempts
    from fxpure.serial import to_data

    found = attempts(report, rules, node)
    # the candidates of other nodes it is part of: a plan that takes it (or drops it, unread), a
    # reason that names it; a node an earlier stage made counts (a later one's plan takes it)
    plans = [p for p in report.plans if p.anchor != node and node in {*p.erase, *p.prune, *(o for o, _ in p.replace)}]
    named = [r for r in report.rejections if r.node != node and r.reason.node == node]
    # the plan that made it, where a stage did (by the name it gave it: one renamed against a clash is
    # not found), and the node is no part of the program as given
    made = [p for p in report.plans if node in {*(n.name for n in p.nodes), *(c.name for c in p.constants)}]
    made = made if node not in report.before.index else []
    if node not in report.before.index and not (found or plans or named or made):
        raise BadInput(f"no node {node!r} in the program{_near(node, report.before)}")
    # a rule's fallback plan, for the reason its pattern gave: "will rewrite" read as the rule's own rewrite
    fallbacks = {(p.rule, p.anchor): p.instead_of for p in report.plans if p.instead_of is not None}
    if as_json:
        tried = []
        for a in found:
            data = to_data(a)
            assert isinstance(data, dict)  # (a record)
            instead = fallbacks.get((a.rule, a.anchor)) if a.reason is None else None
            tried.append({**data, "instead_of": to_data(instead)})
        doc = {"schema": "fxpure.attempts/1", "node": node, "attempts": tried}
        print(_json({**doc, "part_of": to_data([*plans, *named]), "made_by": to_data(made)}))
        return EXIT_OK
    if not found and not plans and not named and not made:  # (a node of the program: one it has not is refused above)
        target = report.before.node(node).target
        print(f"{node} ({target}): no rule among {', '.join(r.name for r in rules)} considers it")
    for a in found:
        outcome = "will rewrite" if a.reason is None else f"declined: {_coded(a.reason)}"
        instead = fallbacks.get((a.rule, a.anchor)) if a.reason is None else None
        if instead is not None:
            outcome = f"will rewrite by fallback, instead of {_coded(instead)}"
        whence = "" if a.anchor == node else f", made from {node} by an earlier rule"
        print(f"{a.rule} at {a.anchor}{whence}: {outcome}")
        said = a.reason if a.reason is not None else instead
        if said is not None:
            print(f"  {said.message}")
        bound = ", ".join(f"{k}={_shown(v)}" for k, v in a.bindings.items())
        print(f"  matched {a.depth} pattern primitives; bound: {bound or 'nothing'}")
    for p in made:
        print(f"{node} is made by {p.rule}'s {'fallback ' if p.instead_of is not None else ''}plan at {p.anchor}")
    for p in plans:
        print(f"{node} is part of {p.rule}'s candidate at {p.anchor}: will rewrite")
    for r in named:
        print(f"{node} is part of {r.rule}'s candidate at {r.node}: declined: {_coded(r.reason)}")
        print(f"  {r.reason.message}")
    return EXIT_OK


def _coded(reason: Reason) -> str:
    """A reason's code and where in the pattern it failed (``at`` would read as a node's name)."""
    return f"{reason.code} (pattern: {reason.path})" if reason.path else reason.code


def _shown(value: Any) -> str:
    name = getattr(value, "name", None) or getattr(value, "key", None)
    text = str(name) if isinstance(name, str) else repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."  # a derived weight's whole expression is long


def apply_cmd(args: argparse.Namespace) -> int:
    """Apply the chosen rules to a saved program, optionally verify and lower it, then save it."""
    from pathlib import Path

    from returns.result import Failure

    from adapters.realize import transform
    from adapters.report import node_meta, to_json
    from adapters.snap import capture_program
    from adapters.validate import check_plans, default_tolerance

    names, rules = [n for n, _ in args.loaded], [r for _, r in args.loaded]
    progress = Progress()
    progress(f"loading {args.model}")
    extras: dict[str, Any] = {}  # saved again beside the program (a tokenizer, say)
    program = _load(args.model, extras)
    uncopied = None  # why the program to verify against could not be kept
    try:
        original = copy.deepcopy(program) if args.verify else None
    except Exception as e:  # weights on the meta device (torch.export.load gives no leaves): no data to verify with
        original, uncopied = None, f"{type(e).__name__}: {_first_line(e)}"
    before = capture_program(program) if args.verify else None
    metas = node_meta(program.graph_module)
    progress("planning and applying")
    result = _planned(lambda: transform(program, rules))
    if isinstance(result, Failure):
        print(f"fxpure: error: {result.failure()} (program unchanged, nothing written)", file=sys.stderr)
        return EXIT_REWRITE_FAILED
    outcome = result.unwrap()
    if uncopied is not None and outcome.changed:  # (transform says why such a program cannot be rewritten)
        print(
            f"fxpure: error: cannot verify {args.model}: no copy of it ({uncopied}); nothing written", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    doc: dict[str, Any] = {"program": args.model, "output": args.output, "changed": outcome.changed}
    code = EXIT_OK
    if before is not None:
        progress("verifying each plan, then the whole program, on random inputs")
        checks = check_plans(before, outcome.report, tolerance=args.tolerance)  # (None: each plan's dtypes')
        if args.tolerance is None:  # (no copy: nothing was rewritten, the program is the original)
            args.tolerance = default_tolerance(original if original is not None else program)
        doc["plan_checks"] = [
            {"rule": c.rule, "anchor": c.anchor, "ok": c.ok, "max_rel": c.max_rel, "note": c.note} for c in checks
        ]
        # rules whose plans made ops that run only in a delegate (not the rules merely named)
        delegated = sorted({p.rule for p in outcome.report.plans for n in p.nodes if n.target.startswith("et_vk.")})
        if not outcome.changed:  # the program as it was: nothing to compare (its inputs may not even be drawable)
            doc["verify"] = {"ok": True, "skipped": "nothing was rewritten"}
        elif delegated:
            why = f"{', '.join(delegated)}: its et_vk kernels run only in the Vulkan delegate, not on this host"
            doc["verify"] = {"ok": True, "skipped": why}
        else:
            assert original is not None  # (changed: copied, else refused above)
            doc["verify"] = _verify(original, program, args.tolerance)
        failed = not doc["verify"]["ok"] or any(c.ok is False for c in checks)
        code = EXIT_VERIFY_FAILED if failed else EXIT_OK
    written = code == EXIT_OK  # a program that failed its check is not written (-o may name the input)
    buffer = None
    if args.pte and written:  # lowered before anything is written: a failure writes nothing
        progress(f"lowering to {args.pte}")
        try:
            buffer = _lower(program, names)
        except Exception as e:  # lowering is executorch's: report it in one line
            first = _first_line(e)
            print(
                f"fxpure: error: lowering to .pte failed ({type(e).__name__}: {first}); nothing written",
                file=sys.stderr,
            )
            return EXIT_REWRITE_FAILED
    if written:
        import torch

        progress(f"saving {args.output}")
        pte = buffer
        _save(
            [(args.output, lambda tmp: torch.export.save(program, tmp, extra_files=extras or None))]
            + ([(args.pte, lambda tmp: Path(tmp).write_bytes(pte))] if pte is not None else [])
        )
        if pte is not None:
            doc["pte"] = args.pte
    doc["written"] = written
    if args.json:
        print(_json(to_json(outcome.report, metas, names, **doc)))
        return code
    plans = outcome.report.plans
    fallbacks = sum(1 for p in plans if p.instead_of is not None)
    by_fallback = f" ({fallbacks} by fallback)" if fallbacks else ""
    wrote = (
        (f"wrote {args.output}" + (" unchanged" if not plans else "") + (f" and {args.pte}" if buffer else ""))
        if written
        else "verification failed: nothing written"
    )
    declined = _count(len(outcome.report.rejections), "candidate") + " declined"
    print(
        f"{_count(len(plans), 'rewrite')} applied{by_fallback}, {declined}; {wrote}"
        if plans
        else f"nothing to rewrite ({declined}); {wrote}"
    )
    for c in doc.get("plan_checks", []):
        state = {True: "ok", False: "FAILED", None: "skipped"}[c["ok"]]
        detail = c["note"] or f"max rel diff {c['max_rel']:.3g}"
        print(f"  plan {c['rule']} at {c['anchor']}: {state} ({detail})")
    if "verify" in doc:
        v = doc["verify"]
        if "skipped" in v:
            ran = sum(1 for c in doc.get("plan_checks", []) if c["ok"] is not None)
            checked = (
                ""
                if not plans
                else f"; {_count(ran, 'plan')} above checked one by one"
                if ran
                else "; no plan could be checked on its own either"
            )
            print(f"verify: whole program not compared ({v['skipped']}){checked}")
        elif "error" in v:
            print(f"verify: FAILED, the programs could not be compared ({v['error']})")
        else:
            skipped = f"; not compared {v['not_compared']}" if "not_compared" in v else ""
            print(
                f"verify: max abs diff {v['max_abs']:.3g}, max rel diff {v['max_rel']:.3g} "
                f"({'ok' if v['ok'] else 'FAILED'}, tolerance {args.tolerance:g}){skipped}"
            )
    return code


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _capped(program: Any, lowered: Any) -> str | None:
    """What the lowering capped: a symbolic size the lowered program takes up to less than
    ``program`` declares (torch's fake conv guards a batch below 16 when a pass first traces a conv
    whose input is a view, say), or None."""
    import torch

    declared = {str(s): r.upper for s, r in (getattr(program, "range_constraints", None) or {}).items()}
    ranges = {str(s): r.upper for s, r in (getattr(lowered, "range_constraints", None) or {}).items()}
    sizes = (d for n in lowered.graph.nodes for d in getattr(n.meta.get("val"), "shape", ()))
    symbol: Any = next((d for d in sizes if isinstance(d, torch.SymInt)), None)
    if symbol is not None:  # the shape environment a later pass narrowed, where the constraints were not
        for s, r in symbol.node.shape_env.var_to_range.items():
            ranges[str(s)] = min(r.upper, ranges.get(str(s), r.upper))
    for sym, upper in declared.items():
        if sym in ranges and ranges[sym] < upper:
            return f"{_dim_of(program, sym)} up to {ranges[sym]} only, where the program takes up to {upper}"
    return None


def _lower(program: Any, names: list[str]) -> bytes:
    """The program lowered to an ExecuTorch .pte: through the Vulkan partitioner when a rule's new
    ops run there (quantized-conv), else with the portable kernels. A size the lowering capped is
    said on stderr (the .pte refuses larger inputs)."""
    import logging

    import executorch.kernels.quantized  # type: ignore[import-untyped]  # noqa: F401  (a PT2E program's q/dq out variants)
    from executorch.exir import to_edge

    logging.disable(logging.INFO)  # partitioners report their progress on the root logger
    try:
        edge = to_edge(copy.deepcopy(program))  # to_edge changes the program it is given; the .pt2 is saved after
        if any(DELEGATED.get(n) == "vulkan" for n in names):
            from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

            edge = edge.to_backend(VulkanPartitioner())
        buffer: bytes = edge.to_executorch().buffer
    finally:
        logging.disable(logging.NOTSET)
    capped = _capped(program, edge.exported_program())
    if capped is not None:
        print(f"fxpure: warning: the .pte takes {capped} (a conv traced again while lowering)", file=sys.stderr)
    return buffer


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxpure`` console script; see README for exit codes."""
    parser = argparse.ArgumentParser(prog="fxpure", description="pure-functional graph rewrites for torch.fx")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run every rule on an embedded CNN, lower to .pte and run it")
    from fxpure.rules import RULES

    rules_help = (
        f"comma-separated rule names from {', '.join(RULES)} (default: {DEFAULT_RULES}), or your own as"
        " module:attribute or file.py:attribute (a rule, or a function that makes one)"
    )
    ex = sub.add_parser("explain", help="show what each rule would rewrite or decline, and why")
    ex.add_argument("model", help="a .pt2 file saved with torch.export.save")
    ex.add_argument("--rules", default=DEFAULT_RULES, help=rules_help)
    ex.add_argument("--edge", action="store_true", help="lower to the edge dialect before planning")
    ex.add_argument("--json", action="store_true", help="machine-readable output (schema fxpure.report/1)")
    ex.add_argument("--node", help="show how far each rule got at this node (reason, pattern path, bindings)")
    ap = sub.add_parser("apply", help="apply the rules and save the rewritten program")
    ap.add_argument("model", help="a .pt2 file saved with torch.export.save")
    ap.add_argument("-o", "--output", required=True, help="where to save the rewritten .pt2")
    ap.add_argument("--rules", default=DEFAULT_RULES, help=rules_help)
    ap.add_argument("--verify", action="store_true", help="compare outputs before/after on random inputs")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max relative difference for --verify (default: 1e-4, or 8 steps of a float16/bfloat16 output)",
    )
    ap.add_argument("--pte", help="also lower to ExecuTorch and write this .pte")
    ap.add_argument("--json", action="store_true", help="machine-readable output (schema fxpure.report/1)")
    args = parser.parse_args(argv)
    try:
        if args.command != "demo":  # bad input is answered before torch is even imported
            args.loaded = _rules(args.rules)
            _check_path(args.model)
            if args.command == "apply":
                _check_writable(args.model, args.output, args.pte)
                if args.tolerance is not None and not 0 < args.tolerance < float("inf"):
                    raise BadInput(f"--tolerance {args.tolerance:g}: not a positive number")
                if args.tolerance is not None and not args.verify:
                    raise BadInput("--tolerance is the tolerance of --verify, which is not given")
        _quiet_libraries()
        if args.command == "demo":
            return demo()
        return explain(args) if args.command == "explain" else apply_cmd(args)
    except BadInput as e:
        print(f"fxpure: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RuleRaised as e:
        unchanged = " (program unchanged, nothing written)" if args.command == "apply" else ""
        print(f"fxpure: error: planning raised {e}{unchanged}", file=sys.stderr)
        return EXIT_REWRITE_FAILED
    except KeyboardInterrupt:  # Ctrl-C: the program was rolled back and temporary files removed
        print("fxpure: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of the output closed it (``| head``): nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush is quiet
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
