"""Every Triton compile of this process and its children, timed (bench/cold_start.py reads it).

On PYTHONPATH with DFLASH_TRITON_LOG=<file>, each Python process (Inductor's compile workers
included: they inherit the environment) appends one JSON line per `triton.compile` call: kernel
name, seconds, pid. Cache hits show as compiles of a few milliseconds."""

import json
import os
import time

_LOG = os.environ.get("DFLASH_TRITON_LOG")

if _LOG:
    try:
        import triton
        import triton.compiler.compiler as _cc
    except ImportError:  # no Triton here: nothing to time
        _cc = None
    if _cc is not None:
        _compile = _cc.compile

        def _name(src) -> str:
            fn = getattr(src, "fn", None)
            return str(getattr(fn, "__name__", None) or getattr(src, "name", None) or getattr(src, "path", src))[:120]

        def timed_compile(src, *args, **kwargs):
            t = time.perf_counter()
            try:
                return _compile(src, *args, **kwargs)
            finally:
                s = time.perf_counter() - t
                with open(_LOG, "a") as f:
                    f.write(json.dumps({"name": _name(src), "s": round(s, 3), "pid": os.getpid(),
                                        "t": round(time.time(), 2)}) + "\n")

        _cc.compile = timed_compile
        triton.compile = timed_compile
        try:  # user kernels (@triton.jit) compile through the name their module imported
            import triton.runtime.jit as _jit

            if getattr(_jit, "compile", None) is _compile:
                _jit.compile = timed_compile
        except ImportError:
            pass
