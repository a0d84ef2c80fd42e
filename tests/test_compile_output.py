"""Native compiler output goes to a per-rank file; the console keeps Python's lines and says where."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging, os, sys
    from dflash_mp import compile_output
    from dflash_mp.metrics import quiet_console
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    quiet_console(True)  # the drafter leader's console: log lines through a wrapper above the bars
    path, fail = sys.argv[1], sys.argv[2] == "fail"
    try:
        with compile_output.to_file(path):
            # A compiler subprocess flooding the inherited descriptors, as ptxas killed mid-compile does.
            os.system("i=0; while [ $i -lt 3000 ]; do i=$((i+1)); echo ptx line $i >&2; echo out $i; done")
            logging.getLogger("x").info("python log line stays on the console")
            print("python print stays on the console", flush=True)
            if fail:
                raise RuntimeError("compile died")
    except RuntimeError:
        pass
    os.system("echo native after the block >&2")
""")


def run(tmp_path, mode):
    path = str(tmp_path / "logs" / "compile_rank_0.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                      os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", SCRIPT, path, mode], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return path, p.stdout, p.stderr


def test_compiler_flood_goes_to_the_file_and_the_console_says_where(tmp_path):
    path, out, err = run(tmp_path, "ok")
    with open(path) as f:
        lines = f.read().splitlines()
    assert sum(line.startswith("ptx line") for line in lines) == 3000
    assert sum(line.startswith("out ") for line in lines) == 3000
    assert "ptx line" not in err and "out 1" not in out  # nothing of the flood on the console
    assert "python log line stays on the console" in err
    assert "python print stays on the console" in out
    assert f"wrote 6000 lines of native output to {path}" in err
    assert "native after the block" in err  # the descriptors are restored


def test_a_failed_compile_shows_the_last_lines_and_the_file(tmp_path):
    path, out, err = run(tmp_path, "fail")
    assert f"compile failed: its native output (6000 lines) is in {path}; the last 20:" in err
    assert "ptx line 3000" in err and "ptx line 2900" not in err
    assert "native after the block" in err
    # A second attempt appends and reports only its own lines.
    path, out, err = run(tmp_path, "ok")
    assert f"wrote 6000 lines of native output to {path}" in err
    with open(path) as f:
        assert len(f.read().splitlines()) == 12000
