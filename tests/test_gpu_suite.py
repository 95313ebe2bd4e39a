"""benchmarks/gpu_suite.py stays working between GPU windows: its --dry-run (CPU, tiny shapes, interpret
mode) runs every part and writes the same files a GPU run writes; a part that fails is recorded as failed
(error + traceback tail) and the later parts still run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["a", "b", "c", "d", "e"]


def _assert_kernel_tests_ran(a: dict, floor: int) -> None:
    """Part a's record: at least `floor` kernel tests ran and passed, none skipped (a run where every kernel
    test skips would otherwise count as `tests` and pass)."""
    ran = a["tests"] - a["skipped"]
    assert a["skipped"] == 0, f"kernel tests skipped in part a: {a.get('skipped_tests')}"
    assert ran >= floor and a["passed"] >= floor, (
        f"part a ran {ran} kernel tests ({a['passed']} passed), want >= {floor}")
    assert a["failures"] == 0 and a["errors"] == 0, a.get("failed_tests")


def _run_suite(out: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("OUT", None)
    env.pop("JAX_PLATFORMS", None)  # the suite sets it for its children
    return subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(out), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_every_part_ok_and_files_written(tmp_path):
    out = tmp_path / "gpu"
    proc = _run_suite(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert list(summary["parts"]) == PARTS
    for part, rec in summary["parts"].items():
        assert rec["status"] == "ok", (part, rec.get("error"), rec.get("traceback_tail"))
        assert rec["seconds"] > 0
    # a: the kernel tests ran (interpret mode on CPU) and wrote a junit file
    a = summary["parts"]["a"]
    dry_tests = _load_suite_module().DRY_KERNEL_TESTS  # the kernel tests a dry run picks: all run on CPU
    assert len(dry_tests) >= 3
    _assert_kernel_tests_ran(a, floor=len(dry_tests))
    assert a["mode"].startswith("interpret")
    assert (out / "kernels_junit.xml").exists()
    # b: the kernel table, timed through the GPU code path (interpreted)
    assert (out / "attention.md").exists() and summary["parts"]["b"]["result"]["bench"] == "attention"
    # c: learner + engine measured, `ulorl plan` predicted, compared
    c = summary["parts"]["c"]["steps"]
    assert c["learner"]["tokens_per_s"] > 0 and c["learner"]["compiled_memory"]["peak_bytes"] > 0
    assert c["engine"]["decode_tokens_per_s"] > 0
    assert c["plan_cpu"]["train"]["peak_bytes"] > 0
    assert summary["parts"]["c"]["comparison"]["train"]["plan_cpu_peak_gb"] > 0
    # d, e: the benches' JSON came back
    assert summary["parts"]["d"]["result"]["bench"] == "compare"
    assert summary["parts"]["e"]["result"]["bench"] == "segments"
    env = json.loads((out / "env.json").read_text())
    assert env["python"] and env["versions"]["jax"] and env["versions"]["jaxlib"] and env["versions"]["flax"]
    assert env["jax_backend"] == "cpu" and isinstance(env["missing"], list)
    md = (out / "summary.md").read_text()
    for text in ("- machine:", "- date:", "- command:", "- versions:", "## a.", "## c.", "## e."):
        assert text in md
    assert (out / "log.txt").stat().st_size > 0
    # what the device tool brings back: at most 8 files, flat
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8


@pytest.mark.slow
def test_failing_part_is_recorded_and_later_parts_still_run(tmp_path):
    out = tmp_path / "gpu"
    proc = _run_suite(out, "--parts", "a,c", "--inject-failure", "a,c")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    parts = summary["parts"]
    assert list(parts) == ["a", "c"]
    assert parts["a"]["status"] == "failed" and "injected failure" in parts["a"]["error"]
    assert "RuntimeError" in parts["a"]["traceback_tail"]
    # c ran after a failed; inside c its learner fails (injected) and the engine and the plan still run
    c = parts["c"]
    assert c["status"] == "failed" and "injected failure" in c["error"] and "RuntimeError" in c["traceback_tail"]
    assert c["steps"]["learner"]["status"] == "failed"
    assert c["steps"]["engine"]["status"] == "ok" and c["steps"]["engine"]["decode_tokens_per_s"] > 0
    assert c["steps"]["plan_cpu"]["status"] == "ok"
    assert "**failed**" in (out / "summary.md").read_text()


def test_all_kernel_tests_skipped_fails_the_dry_run_check(tmp_path):
    """Part a's check on counts parsed from a junit file: three skipped kernel tests fail it, three passed pass."""
    g = _load_suite_module()
    case = '<testcase classname="tests.kernel_tests.t" name="test_{i}">{body}</testcase>'
    for body, ok in (('<skipped message="no GPU"/>', False), ("", True)):
        cases = "".join(case.format(i=i, body=body) for i in range(3))
        skipped = 0 if ok else 3
        (tmp_path / "j.xml").write_text(f'<testsuite tests="3" failures="0" errors="0" skipped="{skipped}">'
                                        f"{cases}</testsuite>")
        a = g.parse_junit(tmp_path / "j.xml")
        if ok:
            _assert_kernel_tests_ran(a, floor=3)
        else:
            with pytest.raises(AssertionError, match="kernel tests skipped"):
                _assert_kernel_tests_ran(a, floor=3)


def test_render_rewrites_markdown_from_json(tmp_path):
    summary = {"dry_run": False, "command": "python benchmarks/gpu_suite.py --out X", "date": "2026-12-03",
               "budget_s": 450, "elapsed_s": 400, "host": "h",
               "env": {"python": "3.12.3", "versions": {"jax": "0.11.2", "jax-cuda13-plugin": "0.11.2"},
                       "devices": ["gpu:NVIDIA H200"], "missing": [{"requirement": "omegaconf>=2.3",
                                                                   "also_needs": ["PyYAML"]}]},
               "parts": {"d": {"status": "skipped", "reason": "needs --device cuda", "seconds": 1.0},
                         "a": {"status": "failed", "seconds": 3.0, "error": "boom", "traceback_tail": "Traceback"}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--render", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "summary.md").read_text()
    assert "gpu:NVIDIA H200" in md and "jax-cuda13-plugin 0.11.2" in md and "`omegaconf>=2.3` (+ PyYAML)" in md
    assert "skipped: needs --device cuda" in md and "**failed**: boom" in md


def _load_suite_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_branches_build_their_commands_without_a_gpu(tmp_path):
    """The branches a dry run does not take (GPU shapes, JAX_PLATFORMS=cuda, budgets), with a fake runner."""
    g = _load_suite_module()
    args = g.build_parser().parse_args(["--out", str(tmp_path)])
    args.parts, args.inject_failure, args.argv = list(g.PARTS), set(), []
    suite = g.Suite(args)
    suite.platform = "cuda"
    calls = []

    def fake_run(label, cmd, timeout, env, background=False):
        calls.append((label, cmd, env))
        stdout = "usage: ulorl bench compare [--threads THREADS]\n" if label == "d_compare_help" else '{"bench": "x"}\n'
        res = {"rc": 0, "stdout": stdout, "stderr": "", "seconds": 1.0, "timed_out": False, "timeout": timeout}
        return {"res": res} if background else res

    suite.run, suite.wait = fake_run, lambda h: h["res"]
    # budgets: every part fits what is left, later parts keep their minimum
    assert suite.part_timeout("a", ["b", "c", "d", "e"]) == g.NOMINAL_S["a"]
    suite.deadline = g.time.monotonic() + 100
    assert suite.part_timeout("c", ["d", "e"]) == g.MIN_S["c"]
    assert suite.part_timeout("e", []) <= 100
    suite.part_b(60)
    suite.part_c(60)
    rec_d = suite.part_d(60)
    suite.part_e(60)
    by = {label: (cmd, env) for label, cmd, env in calls}
    assert "--seq-lens" in by["b_attention"][0] and "4096,16384,65536" in by["b_attention"][0]
    assert by["b_attention"][1]["JAX_PLATFORMS"] == "cuda"
    assert by["b_attention"][1]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert by["c_plan_cpu"][1]["JAX_PLATFORMS"] == "cpu"  # the prediction: XLA's CPU compiler
    assert by["c_learner"][1]["JAX_PLATFORMS"] == "cuda" and by["c_engine"][1]["JAX_PLATFORMS"] == "cuda"
    settings = g.json.loads(by["c_learner"][0][-1])
    assert settings["row_len"] * settings["rows"] >= 8192 and settings["spec"]["arch"]["num_hidden_layers"] == 28
    assert settings["spec"]["dtype"] == "bfloat16" and settings["spec"]["attention_impl"] == "pallas"
    assert rec_d["status"] == "skipped" and "--device cuda" in rec_d["reason"]  # an old compare: no --device
    assert "d_compare" not in by
    help_text = subprocess.run([sys.executable, "-m", "ulorl_jax.cli", "bench", "compare", "--help"],
                               capture_output=True, text=True, cwd=ROOT).stdout
    assert "--device" in help_text  # this checkout's compare has it: part d runs the torch side on CUDA
    real_help = help_text

    def fake_run_with_device(label, cmd, timeout, env, background=False):
        res = fake_run(label, cmd, timeout, env, background)
        if label == "d_compare_help":
            res["stdout"] = real_help
        return res

    suite.run = fake_run_with_device
    suite.part_d(60)
    cmd = [c for label, c, _ in calls if label == "d_compare"][-1]
    assert cmd[cmd.index("--device") + 1] == "cuda" and "all" in cmd
    assert by["e_segments"][0][-3:] == ["--steps", "4", "--json"]
    assert "XLA_FLAGS" not in by["e_segments"][1] or "optimization_level" not in by["e_segments"][1]["XLA_FLAGS"]
    g.shutil.rmtree(suite.tmp, ignore_errors=True)


def test_shim_imports_the_checkout_without_an_install(tmp_path):
    """The device machine has no `pip install -e .`: the shim on PYTHONPATH maps ulorl_jax.kernels and configs."""
    g = _load_suite_module()
    shim = g.make_shim(tmp_path / "shim")
    code = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
            "import ulorl_jax.kernels, ulorl_jax.configs\n"
            "from ulorl_jax.kernels import flash_attention  # noqa: F401\n"
            "print(ulorl_jax.kernels.__file__)")
    env = {**os.environ, "PYTHONPATH": str(shim)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(shim / "ulorl_jax" / "kernels" / "__init__.py")
    counts = g.parse_pytest_lines("[gw0] [ 50%] PASSED tests/t.py::test_a[x]\n"
                                  "tests/t.py::test_b FAILED   [100%]\n")
    assert counts["tests"] == 2 and counts["passed"] == 1 and counts["failures"] == 1
