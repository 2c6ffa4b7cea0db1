#!/usr/bin/env python3
"""Instruction counts of one bench-http server under callgrind (see README.md here).

  callgrind.py drive HOST:PORT N PREFIX first|replay   send N requests on one connection
  callgrind.py summary FILE N                          per request: instructions, memcpy, allocations
  callgrind.py diff BASE FILE N [ROWS]                 per request: self cost by function, FILE - BASE
"""
import collections
import re
import socket
import sys


def body(i):
    # The same body as bench-http's load generator (examples/src/bin/bench-http/load.rs).
    return ('{"amount":%d,"currency":"usd","description":"Order %d placed by the HTTP benchmark",'
            '"metadata":{"customer":"cus_%08x","channel":"web","items":"%d",'
            '"note":"gift wrap, leave at the door"}}'
            % (100 + i % 10000, i, (i * 2654435761) & 0xffffffff, 1 + i % 7))


def drive(addr, n, prefix, scenario):
    host, port = addr.rsplit(':', 1)
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b''
    codes = collections.Counter()
    for i in range(n):
        j = 0 if scenario == 'replay' else i
        b = body(j)
        req = ('POST /v1/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer acct_bench\r\n'
               'Content-Type: application/json\r\nIdempotency-Key: %s-%d\r\n'
               'Content-Length: %d\r\n\r\n%s' % (prefix, j, len(b), b)).encode()
        s.sendall(req)
        while b'\r\n\r\n' not in buf:
            d = s.recv(65536)
            if not d:
                sys.exit('the server closed the connection')
            buf += d
        head, rest = buf.split(b'\r\n\r\n', 1)
        codes[int(head.split(b' ', 2)[1])] += 1
        length = 0
        for line in head.split(b'\r\n')[1:]:
            k, v = line.split(b':', 1)
            if k.strip().lower() == b'content-length':
                length = int(v)
        while len(rest) < length:
            d = s.recv(65536)
            if not d:
                sys.exit('the server closed the connection')
            rest += d
        buf = rest[length:]
    want = 201
    if set(codes) != {want}:
        sys.exit('unexpected statuses: %s' % dict(codes))


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
    print('instructions per request %.0f; memcpy %.0f (bytes copied, about: rep movsb counts each byte); '
          'malloc calls %.1f' % (total / n, memcpy / n, mallocs / n))


def diff(base, path, n, rows):
    a, _ = parse(base)
    b, _ = parse(path)
    print('per request: %.0f -> %.0f instructions' % (sum(a.values()) / n, sum(b.values()) / n))
    for k in sorted(set(a) | set(b), key=lambda k: -(b[k] - a[k]))[:rows]:
        print('%8.0f %8.0f %+8.0f  %s' % (a[k] / n, b[k] / n, (b[k] - a[k]) / n, (k or '?')[:140]))


if __name__ == '__main__':
    cmd = sys.argv[1:2]
    if cmd == ['drive']:
        drive(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    elif cmd == ['summary']:
        summary(sys.argv[2], int(sys.argv[3]))
    elif cmd == ['diff']:
        diff(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 40)
    else:
        sys.exit(__doc__)
