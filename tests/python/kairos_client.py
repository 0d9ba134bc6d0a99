"""A Kairos client in Python, using only the documented wire contract. The
part between the README markers is the Python example of docs/producers.md
(and between the README-schedules markers, of docs/recurring-schedules.md).

    python3 kairos_client.py produce BROKERS SCHEDULE_TOPIC WORK_TOPIC N KEYS DELAY_MS
        Schedules N jobs over KEYS keys, due DELAY_MS from now (each key's jobs
        50 ms apart, in order), through the schedule topic, with the headers the
        wire contract documents. Prints one line per job: "ID KEY SEQ RUN_AT_MS".
        Also writes one malformed job (garbage run-at) and prints "BAD ID".

    python3 kairos_client.py keys BROKERS TOPIC KEY...
        Writes one record per key to TOPIC, keyed, with the header
        kairos-client=python, and prints "KEY PARTITION" for each.

    python3 kairos_client.py define BROKERS SCHEDULES_TOPIC ID WORK_TOPIC START_MS N
        Defines recurring schedule ID, every second from START_MS for N
        occurrences, on WORK_TOPIC; prints the N occurrences' job ids as
        "OCCURRENCE ID".

    python3 kairos_client.py dead BROKERS DEAD_TOPIC N
        Reads N records from the dead-letter topic and prints
        "DEAD ID REASON" for each.
"""
import sys
import time
import uuid

from confluent_kafka import Consumer, Producer


# README:begin
def producer(brokers):
    return Producer({
        "bootstrap.servers": brokers,
        "enable.idempotence": True,
        # Hash keys with murmur2 as Java and Kairos do (librdkafka's default
        # differs): a key's jobs land on the same partition.
        "partitioner": "murmur2_random",
    })


def schedule(p, schedule_topic, work_topic, key, payload, run_at_ms):
    """Schedule a job through schedule_topic: payload runs on work_topic at run_at_ms."""
    job_id = str(uuid.uuid4())  # the job id: handlers deduplicate on it
    p.produce(schedule_topic, key=key, value=payload, headers=[
        ("kairos-id", job_id),
        ("kairos-run-at", str(run_at_ms)),  # epoch milliseconds (or RFC 3339)
        ("kairos-topic", work_topic),
        ("kairos-tenant", "python"),
    ])
    return job_id
# README:end


# README-schedules:begin
import json
from datetime import datetime, timezone

OCCURRENCES = uuid.UUID("6b616972-6f73-4a00-8000-726563757272")


def define(p, schedules_topic, schedule_id, cron, work_topic, payload, **options):
    """Define (or replace) a recurring schedule: each occurrence runs payload on work_topic."""
    definition = {"id": schedule_id, "cron": cron,
                  "job": {"topic": work_topic, "payload": payload}, **options}
    p.produce(schedules_topic, key=schedule_id, value=json.dumps(definition))


def occurrence_id(schedule_id, nominal_ms):
    """The job id of the schedule's occurrence at nominal_ms (epoch milliseconds)."""
    return str(uuid.uuid5(OCCURRENCES, f"{schedule_id}@{nominal_ms}"))
# README-schedules:end


def define_every_second(brokers, schedules_topic, schedule_id, work, start_ms, n):
    p = producer(brokers)
    iso = lambda ms: datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat().replace("+00:00", "Z")
    define(p, schedules_topic, schedule_id, "* * * * * *", work, "from python",
           time_zone="America/New_York", start=iso(start_ms), end=iso(start_ms + (n - 1) * 1000),
           misfire="all")
    if p.flush(30) != 0:
        sys.exit("not every record was acknowledged")
    for i in range(n):
        print("OCCURRENCE", occurrence_id(schedule_id, start_ms + i * 1000))


def produce(brokers, schedule_topic, work, n, keys, delay_ms):
    p = producer(brokers)
    base = int(time.time() * 1000) + delay_ms
    for i in range(n):
        key = f"py-{i % keys}"
        seq = i // keys
        run_at = base + seq * 50
        job_id = schedule(p, schedule_topic, work, key, f"from python {i}".encode(), run_at)
        print(job_id, key, seq, run_at)
    bad = str(uuid.uuid4())
    p.produce(schedule_topic, key="py-bad", value=b"bad", headers=[
        ("kairos-id", bad),
        ("kairos-run-at", "in a while"),
        ("kairos-topic", work),
    ])
    print("BAD", bad)
    if p.flush(30) != 0:
        sys.exit("not every record was acknowledged")


def keys(brokers, topic, names):
    p = producer(brokers)
    for k in names:
        p.produce(topic, key=k, value=b"x", headers=[("kairos-client", "python")],
                  on_delivery=lambda err, m: print(m.key().decode(), m.partition()) if err is None
                  else sys.exit(f"{m.key()}: {err}"))
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
    elif cmd == "define":
        define_every_second(args[0], args[1], args[2], args[3], int(args[4]), int(args[5]))
    elif cmd == "dead":
        dead(args[0], args[1], int(args[2]))
    elif cmd == "keys":
        keys(args[0], args[1], args[2:])
    else:
        sys.exit(f"unknown command {cmd}")
