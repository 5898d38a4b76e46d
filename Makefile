# One entry point for people and CI: `make test` (what .ci/run calls), `make demo`, `make bench`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fxpure-installed

.PHONY: setup test check demo bench clean mutate

setup: $(STAMP)

# torch first and pinned exactly: the CPU wheel on this machine's disk; a loose spec pulls a CUDA build
$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

check: setup
	$(BIN)/mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test: check
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/fxpure demo

# every rule against the FX floor and upstream, one table; writes benchmarks/results.json and .png
bench: setup
	$(BIN)/python -m benchmarks.suite

clean:
	rm -rf $(VENV)

# Mutation testing of the torch-free core: mutmut (config: [tool.mutmut] in pyproject.toml) mutates
# fxpure/ into mutants/ and runs the torch-free tests (tests/core, less the two generated-graph
# tests, and the doctests) that cover each mutant; then prints the score, overall and per file.
# Long (about 7,400 mutants: hours on 2 shared cores): not part of `make test`; see MUTATION.md.
# MUTATE_JOBS=N workers;
# MUTATE_KEEP=1 reuses the last run's results (only changed mutants run again).
MUTATE_JOBS ?= 2
mutate: setup
	$(if $(MUTATE_KEEP),,rm -rf mutants)
	nice $(BIN)/mutmut run --max-children $(MUTATE_JOBS) > mutants.log 2>&1 || (tail -c 3000 mutants.log; exit 1)
	$(BIN)/python -c "$$MUTATION_SCORE"

define MUTATION_SCORE
import collections, json, pathlib
status = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout"}
status.update({0: "survived", 5: "no tests", 33: "no tests", None: "not checked"})
rows, total = [], collections.Counter()
for meta in sorted(pathlib.Path("mutants").rglob("*.py.meta")):
    exits = list(json.loads(meta.read_text())["exit_code_by_key"].values())
    if exits:
        c = collections.Counter(status.get(e, "other") for e in exits)
        rows.append((str(meta.relative_to("mutants"))[:-5], c))
        total.update(c)
def line(name, c):
    n, dead = sum(c.values()), c["killed"] + c["timeout"]
    rest = ", ".join(f"{k} {c[k]}" for k in ("survived", "no tests", "not checked", "other") if c[k])
    return f"{name:<40} {dead:>5} / {n:<5} {100 * dead / n:6.2f}%   {rest}"
print(f"{'file':<40} killed / total")
for name, c in rows:
    print(line(name, c))
print(line("mutation score", total))
endef
export MUTATION_SCORE
