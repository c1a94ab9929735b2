"""Manual smoke test against a RUNNING server (not collected by pytest: no test_ prefix).

Switches the server to `albatross workers=1 batch=16`, sends one non-stream and one stream chat
request, and prints the status codes and the first text.

    python main.py --port 8000 &
    python tests/manual_albatross_smoke.py --url http://127.0.0.1:8000 --model models/rwkv7-tiny.pth
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx

STRATEGY = "albatross workers=1 batch=16"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="checkpoint path as the server sees it")
    parser.add_argument("--password")
    parser.add_argument("--strategy", default=STRATEGY)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.password}"} if args.password else {}
    chat = {"messages": [{"role": "user", "content": "Say hello in three languages."}], "max_tokens": args.max_tokens}
    ok = True
    with httpx.Client(base_url=args.url, headers=headers, timeout=600.0) as client:
        switch = client.post("/switch-model", json={"model": args.model, "strategy": args.strategy})
        print(f"POST /switch-model ({args.strategy}): {switch.status_code} {switch.text[:200]}")
        ok &= switch.status_code == 200

        status = client.get("/status")
        print(f"GET /status: {status.status_code} {status.text[:300]}")

        reply = client.post("/v1/chat/completions", json={**chat, "stream": False})
        print(f"POST /v1/chat/completions (non-stream): {reply.status_code}")
        if reply.status_code == 200:
            body = reply.json()
            print(f"  text: {body['choices'][0]['message']['content'][:200]!r}")
            print(f"  finish_reason: {body['choices'][0]['finish_reason']}, usage: {body.get('usage')}")
        else:
            ok = False
            print(f"  body: {reply.text[:300]}")

        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
            print(f"POST /v1/chat/completions (stream): {stream.status_code}")
            ok &= stream.status_code == 200
            first, chunks = None, 0
            for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                data = json.loads(line[6:])
                if "error" in data:
                    ok = False
                    print(f"  error event: {data['error']}")
                    break
                for choice in data.get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if content and first is None:
                        first = content
            print(f"  first text: {first!r}, chunks: {chunks}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
