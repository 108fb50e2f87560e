# forkd code-context driver: a persistent Python interpreter the agent talks to.
#
# Requests arrive as JSON lines on stdin; events leave as JSON lines on stdout. Before any
# user code runs, both are moved to private descriptors: user code sees /dev/null as its
# stdin, and whatever it (or a subprocess, or a C extension) writes to fd 1 and fd 2 is
# captured and sent as stdout/stderr events. Python-level print() goes straight to
# events, so it keeps its order relative to results and errors.
import ast
import base64
import codecs
import io
import json
import os
import signal
import sys
import threading
import traceback

_requests = os.fdopen(os.dup(0), "r", encoding="utf-8", closefd=True)
_events = os.fdopen(os.dup(1), "w", encoding="utf-8", closefd=True)
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)
_lock = threading.Lock()


def _emit(event):
    line = json.dumps(event, ensure_ascii=False)
    with _lock:
        _events.write(line + "\n")
        _events.flush()


class _TextStream(io.TextIOBase):
    """sys.stdout / sys.stderr: every write becomes an event."""

    def __init__(self, kind, fd):
        self._kind = kind
        self._fd = fd

    def writable(self):
        return True

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not %s" % type(s).__name__)
        if s:
            _emit({"type": self._kind, "text": s})
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False

    def fileno(self):
        return self._fd

    @property
    def encoding(self):
        return "utf-8"


class _FdCapture:
    """Captures one of the process's own descriptors (1 or 2) through a pipe."""

    def __init__(self, kind, fd):
        self.kind = kind
        self.fd = fd
        self.marker = ("\x00forkd-sync-%s\x00" % os.urandom(8).hex()).encode()
        self.synced = threading.Event()
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        self._r = r
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = b""
        keep = len(self.marker) - 1
        while True:
            data = os.read(self._r, 65536)
            if not data:
                return
            pending += data
            while True:
                at = pending.find(self.marker)
                if at < 0:
                    break
                self._send(decoder.decode(pending[:at]))
                pending = pending[at + len(self.marker):]
                self.synced.set()
            # Hold back a tail that may be the start of a marker.
            cut = max(0, len(pending) - keep)
            self._send(decoder.decode(pending[:cut]))
            pending = pending[cut:]

    def _send(self, text):
        if text:
            _emit({"type": self.kind, "text": text})

    def sync(self):
        """Waits until everything written to the descriptor so far was sent."""
        self.synced.clear()
        os.write(self.fd, self.marker)
        self.synced.wait(5)


_captures = [_FdCapture("stdout", 1), _FdCapture("stderr", 2)]
sys.stdout = _TextStream("stdout", 1)
sys.stderr = _TextStream("stderr", 2)
sys.stdin = open(os.devnull, "r")

_namespace = {"__name__": "__main__", "__builtins__": __builtins__}
_count = 0


def _png_of(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _is_figure(value):
    mod = sys.modules.get("matplotlib.figure")
    return mod is not None and isinstance(value, mod.Figure)


def _result(value):
    event = {"type": "result", "text": repr(value)}
    if _is_figure(value):
        event["png"] = _png_of(value)
        return event
    html = getattr(value, "_repr_html_", None)
    if callable(html):
        try:
            rendered = html()
        except Exception:
            rendered = None
        if isinstance(rendered, str):
            event["html"] = rendered
    return event


def _open_figures():
    """Figures left open by the cell (pyplot's implicit figures), as notebook kernels
    show them; they are closed once sent."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        fig = plt.figure(num)
        _emit({"type": "result", "text": repr(fig), "png": _png_of(fig)})
    plt.close("all")


def _user_traceback(exc):
    tb = exc.__traceback__
    # Drop the driver's own frames: the user's code starts at the first '<cell>' frame.
    while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
        tb = tb.tb_next
    if isinstance(exc, SyntaxError):
        tb = None
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _run(code, env=None):
    global _count
    _count += 1
    # Variables for this run only: set for the cell, then put back as they were.
    saved = {}
    if isinstance(env, dict):
        for k, v in env.items():
            k = str(k)
            saved[k] = os.environ.get(k)
            os.environ[k] = str(v)
    # The agent interrupts a cell that runs past its timeout with SIGINT; outside a cell
    # the signal is ignored so that a late one cannot kill the driver.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), _namespace)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), _namespace)
            if value is not None:
                _namespace["_"] = value
                _emit(_result(value))
                if _is_figure(value):
                    sys.modules["matplotlib.pyplot"].close(value)
        _open_figures()
    except BaseException as exc:  # SystemExit and KeyboardInterrupt end the cell only
        _emit(
            {
                "type": "error",
                "name": type(exc).__name__,
                "value": str(exc),
                "traceback": _user_traceback(exc),
            }
        )
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _reseed(env):
    import random

    # The child's own environment (given when it was created) joins the template's.
    if isinstance(env, dict):
        os.environ.update({str(k): str(v) for k, v in env.items()})

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _emit({"type": "ready", "pid": os.getpid()})
    for line in _requests:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        op = req.get("op")
        if op == "run":
            _run(req.get("code", ""), req.get("env"))
        elif op == "reseed":
            _reseed(req.get("env"))
        for cap in _captures:
            cap.sync()
        _emit({"type": "done", "execution_count": _count})


main()
