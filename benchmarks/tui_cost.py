"""Does the terminal app's chat screen take CPU from the engine? One chat reply shown in the
chat screen (headless, Textual's pilot) against the same /api/chat request through plain
HTTP, on the same daemon, alternating: the daemon's decode tok/s for each, and the app
process's CPU seconds per reply. Usage: EDGEINFER_HOST=... python benchmarks/tui_cost.py"""
import asyncio, json, os, resource, sys, time
import httpx
from edgeinfer.tui.app import EdgeInferApp
from edgeinfer.tui.widgets.stream_status import StreamStatus

HOST = "http://" + os.environ.get("EDGEINFER_HOST", "127.0.0.1:11435")
MODEL = "gemma3:270m"
PROMPT = "Tell me a long story about a lighthouse keeper."
OPTS = {"temperature": 0.8}   # what the TUI sends

def curl_once():
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "options": OPTS}
    with httpx.stream("POST", HOST + "/api/chat", json=body, timeout=300) as r:
        for line in r.iter_lines():
            d = json.loads(line)
            if d.get("done"):
                return d["eval_count"] / (d["eval_duration"] / 1e9)

async def tui_once():
    app = EdgeInferApp(HOST, autostart=False)
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(200):
            await pilot.pause(0.05)
            sel = app.screen.query_one("#model")
            if getattr(sel, "value", None) == MODEL:
                break
        app.screen.query_one("#temperature").value = "0.8"
        p = app.screen.query_one("#prompt")
        p.focus(); p.value = PROMPT
        await pilot.press("enter")
        st = app.screen.query_one(StreamStatus)
        for _ in range(6000):
            await pilot.pause(0.05)
            if st.state in ("done", "error", "stopped"):
                break
        return st.tokens_per_s, st.tokens

def curl_with_stats_stream():
    """curl while another client follows /api/stats/stream (what the TUI app does)."""
    import threading
    stop = threading.Event()
    def follow():
        with httpx.stream("GET", HOST + "/api/stats/stream", timeout=300) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    t = threading.Thread(target=follow, daemon=True); t.start()
    time.sleep(0.5)
    try:
        return curl_once()
    finally:
        stop.set()


if __name__ == "__main__":
    for i in range(3):
        c = curl_once()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t = asyncio.run(tui_once())
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        print(f"round {i}: curl {c:.1f} tok/s | app {t[0]:.1f} tok/s ({t[1]} tokens), "
              f"app CPU {cpu:.1f} s")
