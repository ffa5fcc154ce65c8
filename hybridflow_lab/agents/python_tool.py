"""A Python tool: the policy's code runs in a child process with a time and memory limit and no network, never
``eval`` in the controller.

The child is a fresh isolated interpreter (``python -I``, an empty environment, a scratch working directory) whose
first act is an audit hook (PEP 578) refusing sockets, new processes and ``ctypes`` (which could remove the hook);
``RLIMIT_AS`` caps its memory and ``RLIMIT_CPU`` its CPU seconds, and the parent kills it at the wall-clock limit.
What it prints is the result; an exception's last line follows it. This is a guard against a policy's accidents
(a runaway loop, a huge list, an import of ``requests``), not a sandbox against an adversary: for that, run tools in
a container.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile

from hybridflow_lab.agents.environment import cut
from hybridflow_lab.agents.tools import Tool, as_tool

BLOCKED_EVENTS = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                  "os.forkpty", "os.kill", "pty.spawn")
BLOCKED_IMPORTS = ("ctypes", "_ctypes")
# runs first in the child: the limits, then the audit hook, then the policy's code from stdin
BOOTSTRAP = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
resource.setrlimit(resource.RLIMIT_CPU, (int(sys.argv[2]), int(sys.argv[2])))
source = sys.stdin.read()
def refuse(event, args):
    if event.startswith({BLOCKED_EVENTS!r}) or (event == "import" and args[0] in {BLOCKED_IMPORTS!r}):
        what = f"import {{args[0]}}" if event == "import" else event
        raise PermissionError(f"{{what}} is not allowed in the Python tool")
sys.addaudithook(refuse)
del refuse, resource
exec(compile(source, "<tool>", "exec"), {{"__name__": "__main__"}})
"""


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, max_chars: int = 2000) -> str:
    """What ``code`` prints in a child process under the limits (the module docstring); an error's last line is
    appended, and a run past ``timeout_s`` says so."""
    with tempfile.TemporaryDirectory(prefix="hybridflow-python-tool-") as scratch:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", BOOTSTRAP, str(memory_mb * 2**20),
                                   str(max(1, int(timeout_s)))], input=code, capture_output=True, text=True,
                                  timeout=timeout_s, cwd=scratch, env={})
        except subprocess.TimeoutExpired as exc:
            printed = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return cut(f"{printed}error: the code ran past {timeout_s:g} s and was stopped", max_chars)
    output = done.stdout
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        reason = lines[-1] if lines else f"the process ended with code {done.returncode}"
        if done.returncode < 0:
            reason = f"the process was killed by signal {-done.returncode} (a memory or CPU limit)"
        output += f"error: {reason}"
    return cut(output.strip() or "(nothing printed: print the result)", max_chars)


def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: a Python program; print the values you need, e.g. print(2**100)
    """
    return run_python(code)


def python_tool(timeout_s: float = 5.0, memory_mb: int = 512, max_chars: int = 2000) -> Tool:
    """The ``python`` tool under these limits (its schema is ``python``'s)."""
    limited = functools.partial(run_python, timeout_s=timeout_s, memory_mb=memory_mb, max_chars=max_chars)
    return Tool(limited, as_tool(python).schema)
