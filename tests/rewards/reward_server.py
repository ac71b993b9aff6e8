"""A real reward server for the remote-reward tests: ``python reward_server.py PORT_FILE [--mode M]``.

Endpoints: ``POST /score`` (hyperrl's contract: 1.0 when a completion equals its answer), ``POST /get_reward``
(OpenRLHF's: 1.0 when the query ends with its label), ``POST /v1/chat/completions`` (a scripted judge: it answers
``{"score": 1}`` when the prompt says "right", ``{"score": 0}`` for "wrong", and hedges otherwise), ``GET /stats``
(the row count of every request so far).
Modes: ``ok``; ``slow`` (each request waits 0.5 s); ``flaky`` (the first two requests answer HTTP 503);
``garbage`` (answers a list of the wrong length); ``die`` (exits at its third request, without answering).
"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "ok"
SIZES: list[int] = []
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _answer(self, code: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        with LOCK:
            self._answer(200, {"sizes": SIZES})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/chat/completions":
            said = body["messages"][-1]["content"]
            verdict = ('Verdict: {"score": 1}' if "right" in said else 'I think {"score": 0}' if "wrong" in said
                       else "I cannot tell.")
            return self._answer(200, {"choices": [{"message": {"role": "assistant", "content": verdict}}]})
        with LOCK:
            k = len(SIZES)
            SIZES.append(len(body.get("completions", body.get("query", []))))
        if MODE == "die" and k == 2:
            os._exit(1)
        if MODE == "flaky" and k < 2:
            return self._answer(503, {"error": "warming up"})
        if MODE == "slow":
            time.sleep(0.5)
        if self.path == "/get_reward":
            rewards = [float(q.endswith(str(lab))) for q, lab in zip(body["query"], body["labels"])]
        else:
            rewards = [float(c == a) for c, a in zip(body["completions"], body["answer"])]
        if MODE == "garbage":
            rewards = rewards[:-1]
        self._answer(200, {"rewards": rewards})


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    server.serve_forever()
