"""A sniffer for the tests: every frame on an interface, appended to a file (4-byte length, then the
frame) until it is killed. argv: interface, file. Prints `capturing` once the socket is bound."""
import socket
import struct
import sys

ETH_P_ALL = 3
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
sock.bind((sys.argv[1], 0))
with open(sys.argv[2], "wb", buffering=0) as out:
    print("capturing", flush=True)
    while True:
        frame = sock.recv(1 << 18)   # a GSO segment on a veth can be 64 KiB
        out.write(struct.pack("!I", len(frame)) + frame)
