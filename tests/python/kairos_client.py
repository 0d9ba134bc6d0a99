"""A Kairos client in Python, using only the documented wire contract.

    python3 kairos_client.py produce BROKERS SCHEDULE_TOPIC WORK_TOPIC N KEYS DELAY_MS
        Schedules N jobs over KEYS keys, due DELAY_MS from now (each key's jobs
        50 ms apart, in order), through the schedule topic, with the headers the
        README documents. Prints one line per job: "ID KEY SEQ RUN_AT_MS".
        Also writes one malformed job (garbage run-at) and prints "BAD ID".

    python3 kairos_client.py dead BROKERS DEAD_TOPIC N
        Reads N records from the dead-letter topic and prints
        "DEAD ID REASON" for each.
"""
import sys
import time
import uuid

from confluent_kafka import Consumer, Producer


def produce(brokers, schedule, work, n, keys, delay_ms):
    p = Producer({
        "bootstrap.servers": brokers,
        "enable.idempotence": True,
        "partitioner": "murmur2_random",
    })
    base = int(time.time() * 1000) + delay_ms
    for i in range(n):
        key = f"py-{i % keys}"
        seq = i // keys
        job_id = str(uuid.uuid4())
        run_at = base + seq * 50
        p.produce(schedule, key=key, value=f"from python {i}".encode(), headers=[
            ("kairos-id", job_id),
            ("kairos-run-at", str(run_at)),
            ("kairos-topic", work),
            ("kairos-tenant", "python"),
        ])
        print(job_id, key, seq, run_at)
    bad = str(uuid.uuid4())
    p.produce(schedule, key="py-bad", value=b"bad", headers=[
        ("kairos-id", bad),
        ("kairos-run-at", "in a while"),
        ("kairos-topic", work),
    ])
    print("BAD", bad)
    if p.flush(30) != 0:
        sys.exit("not every record was acknowledged")


def dead(brokers, topic, n):
    c = Consumer({
        "bootstrap.servers": brokers,
        "group.id": f"py-dead-{uuid.uuid4()}",
        "auto.offset.reset": "earliest",
    })
    c.subscribe([topic])
    seen = 0
    deadline = time.time() + 30
    while seen < n and time.time() < deadline:
        m = c.poll(0.2)
        if m is None or m.error():
            continue
        headers = dict(m.headers() or [])
        print("DEAD", headers.get("kairos-id", b"").decode(), headers.get("kairos-dead-reason", b"").decode())
        seen += 1
    c.close()
    if seen < n:
        sys.exit(f"read {seen} of {n} dead letters")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "produce":
        produce(args[0], args[1], args[2], int(args[3]), int(args[4]), int(args[5]))
    elif cmd == "dead":
        dead(args[0], args[1], int(args[2]))
    else:
        sys.exit(f"unknown command {cmd}")
