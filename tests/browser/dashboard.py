"""Drive the scheduler's dashboard in headless Chromium over the DevTools
protocol: load the page, wait for it to show /status, /dlq and /schedules,
read what it shows (the dead letters' and schedules' cells as text, and whether any markup from them
ran: `document.body.dataset.pwned` is what the test's hostile dead letters
would set), click "Replay new dead jobs", wait for the answer, save a
screenshot.

Usage: dashboard.py URL SCREENSHOT.png
Prints one JSON object: what the page showed and what the replay said.
Chromium: $KAIROS_CHROMIUM, or chromium / chromium-browser / google-chrome on PATH.
"""

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket  # websocket-client

TIMEOUT_S = 30


def browser():
    for c in [os.environ.get("KAIROS_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]:
        if c and shutil.which(c):
            return shutil.which(c)
    sys.exit("no Chromium found (set KAIROS_CHROMIUM, or install Debian's chromium)")


def wait_for(what, check):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    sys.exit(f"timed out after {TIMEOUT_S} s waiting for {what}")


class Page:
    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # events in between are skipped
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    sys.exit(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            sys.exit(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")


def main():
    url, shot = sys.argv[1], sys.argv[2]
    profile = tempfile.mkdtemp(prefix="kairos-chromium-")
    proc = subprocess.Popen(
        [browser(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1000,1200",
         "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = os.path.join(profile, "DevToolsActivePort")
        wait_for("Chromium's DevTools port", lambda: os.path.exists(port_file) and os.path.getsize(port_file) > 0)
        port = open(port_file).read().split()[0]
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=TIMEOUT_S))
        target = next(t for t in targets if t["type"] == "page")
        page = Page(websocket.create_connection(target["webSocketDebuggerUrl"], timeout=TIMEOUT_S))
        page.call("Page.enable")
        page.call("Page.navigate", url=url)
        wait_for("the page to show /status and /dlq", lambda: page.eval(
            "document.body && document.body.dataset.loaded === 'status' && document.body.dataset.dead !== undefined"
            " && document.body.dataset.schedules !== undefined"))
        shown = page.eval("""({
            pending: +document.getElementById('pending').textContent,
            due_now: +document.getElementById('due-now').textContent,
            fired: +document.getElementById('fired').textContent,
            dead: +document.getElementById('dead').textContent,
            dead_rows: document.querySelectorAll('#dead-rows tr').length,
            bars: [...document.querySelectorAll('#timeline rect.bar')].map(r => +r.dataset.jobs),
            later: document.getElementById('later').textContent,
            dead_cells: [...document.querySelectorAll('#dead-rows tr')].map(r => [...r.cells].map(c => c.textContent)),
            elements_in_rows: document.querySelectorAll('#dead-rows td *').length,
            schedule_cells: [...document.querySelectorAll('#schedule-rows tr')].map(r => [...r.cells].map(c => c.textContent)),
            elements_in_schedule_rows: document.querySelectorAll('#schedule-rows td *').length,
        })""")
        # Let any image the rows made finish loading or failing (its error
        # handler, had it been parsed, would have run by then).
        page.eval("""Promise.all([...document.images].map(i => i.complete ? 0 :
            new Promise(r => { i.addEventListener('load', r); i.addEventListener('error', r); })))""")
        shown["images"] = page.eval("document.images.length")
        shown["pwned"] = page.eval("document.body.dataset.pwned ?? null")
        page.eval("document.getElementById('replay').click()")
        wait_for("the replay's answer", lambda: page.eval("document.body.dataset.replayed !== undefined"))
        shown["replayed"] = page.eval("+document.body.dataset.replayed")
        shown["replay_text"] = page.eval("document.getElementById('replay-result').textContent")
        png = page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(shot, "wb") as f:
            f.write(base64.b64decode(png))
        print(json.dumps(shown))
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
