#!/usr/bin/env python3
"""Instruction counts of one bench-http server under callgrind (see README.md here).

  callgrind.py measure HOST:PORT PID WARMUP N first|replay
      on one keep-alive connection: WARMUP requests, zero callgrind's counters (PID is the
      valgrind process), N requests, dump the counts (`callgrind_control`)
  callgrind.py summary FILE N      per request: instructions, memcpy, malloc calls
  callgrind.py diff BASE FILE N [ROWS]
      per request: each function's own instructions in BASE and FILE, largest changes first
"""
import collections
import re
import socket
import subprocess
import sys


def body(i):
    # The same body as bench-http's load generator (examples/src/bin/bench-http/load.rs).
    return ('{"amount":%d,"currency":"usd","description":"Order %d placed by the HTTP benchmark",'
            '"metadata":{"customer":"cus_%08x","channel":"web","items":"%d",'
            '"note":"gift wrap, leave at the door"}}'
            % (100 + i % 10000, i, (i * 2654435761) & 0xffffffff, 1 + i % 7))


class Client:
    """One keep-alive connection sending the benchmark's requests."""

    def __init__(self, addr):
        host, port = addr.rsplit(':', 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b''

    def recv(self):
        d = self.sock.recv(65536)
        if not d:
            sys.exit('the server closed the connection')
        self.buf += d

    def send(self, key, n):
        """POSTs order `n` under `key`; returns the status and the Idempotent-Replayed value."""
        b = body(n)
        self.sock.sendall(
            ('POST /v1/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer acct_bench\r\n'
             'Content-Type: application/json\r\nIdempotency-Key: %s\r\n'
             'Content-Length: %d\r\n\r\n%s' % (key, len(b), b)).encode())
        while b'\r\n\r\n' not in self.buf:
            self.recv()
        head, self.buf = self.buf.split(b'\r\n\r\n', 1)
        status = int(head.split(b' ', 2)[1])
        length, replayed = 0, None
        for line in head.split(b'\r\n')[1:]:
            k, v = line.split(b':', 1)
            k = k.strip().lower()
            if k == b'content-length':
                length = int(v)
            elif k == b'idempotent-replayed':
                replayed = v.strip().decode()
        while len(self.buf) < length:
            self.recv()
        self.buf = self.buf[length:]
        return status, replayed


def run(client, first, n, scenario):
    """Requests first..first+n: each under a new key, or every one a replay of key 0 (its
    first request, made during the warm-up, executes). The bare arm sends no
    Idempotent-Replayed header; the annotated one must say what the scenario expects."""
    for i in range(first, first + n):
        key = 'order-%d' % (0 if scenario == 'replay' else i)
        status, replayed = client.send(key, 0 if scenario == 'replay' else i)
        if status != 201:
            sys.exit('request %d: status %d' % (i, status))
        expected = 'true' if scenario == 'replay' and i > 0 else 'false'
        if replayed is not None and replayed != expected:
            sys.exit('request %d: Idempotent-Replayed: %s, expected %s' % (i, replayed, expected))


def measure(addr, pid, warmup, n, scenario):
    if scenario not in ('first', 'replay'):
        sys.exit('scenario: first or replay, not %r' % scenario)
    if warmup < 1:
        sys.exit('at least one warm-up request')
    client = Client(addr)
    run(client, 0, warmup, scenario)
    subprocess.run(['callgrind_control', '-z', str(pid)], check=True, stdout=subprocess.DEVNULL)
    run(client, warmup, n, scenario)
    subprocess.run(['callgrind_control', '-d', 'measured', str(pid)], check=True,
                   stdout=subprocess.DEVNULL)


def parse(path):
    """Self cost (first event) by function, and calls into each callee: {callee: [calls, inclusive]}."""
    names, selfc = {}, collections.Counter()
    into = collections.defaultdict(lambda: [0, 0])
    fn = cfn = None
    pending = None
    npos = 1

    def name(tok):
        m = re.match(r'\((\d+)\)(?:\s+(.*))?', tok)
        if not m:
            return tok
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), tok)

    for line in open(path):
        line = line.rstrip('\n')
        if line.startswith('positions:'):
            npos = len(line.split()) - 1
        elif line.startswith('fn='):
            fn = name(line[3:])
        elif line.startswith('cfn='):
            cfn = name(line[4:])
        elif line.startswith('calls='):
            pending = int(line[6:].split()[0])
        elif line and (line[0].isdigit() or line[0] in '+-*'):
            cost = line.split()[npos:]
            ir = int(cost[0]) if cost else 0
            if pending is not None:
                into[cfn][0] += pending
                into[cfn][1] += ir
                pending = None
            else:
                selfc[fn] += ir
    return selfc, into


def summary(path, n):
    selfc, into = parse(path)
    total = sum(selfc.values())
    memcpy = sum(v for k, v in selfc.items() if k and k.startswith('__memcpy'))
    mallocs = into.get('malloc', [0, 0])[0]
    print('instructions per request %.0f; memcpy instructions %.0f (for a large copy, about its '
          'bytes: rep movsb counts one per byte); malloc calls %.1f' % (total / n, memcpy / n, mallocs / n))


def diff(base, path, n, rows):
    a, _ = parse(base)
    b, _ = parse(path)
    print('per request: %.0f -> %.0f instructions' % (sum(a.values()) / n, sum(b.values()) / n))
    for k in sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k]))[:rows]:
        print('%8.0f %8.0f %+8.0f  %s' % (a[k] / n, b[k] / n, (b[k] - a[k]) / n, (k or '?')[:140]))


if __name__ == '__main__':
    cmd = sys.argv[1:2]
    if cmd == ['measure']:
        measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif cmd == ['summary']:
        summary(sys.argv[2], int(sys.argv[3]))
    elif cmd == ['diff']:
        diff(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 40)
    else:
        sys.exit(__doc__)
