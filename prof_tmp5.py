import time, statistics, random, msgspec, numpy as np
from numba import njit
toks=[random.randrange(128000) for _ in range(8192)]
enc=msgspec.msgpack.Encoder().encode
raw=enc(toks); buf=np.frombuffer(raw,dtype=np.uint8); out=np.empty(512,dtype=np.uint64)
K = np.array([(0x9E3779B97F4A7C15 * (2*i+1)) & ((1<<64)-1) for i in range(64)], dtype=np.uint64)
@njit(cache=False, nogil=True, boundscheck=False)
def parse_nh(buf, pos, block_size, max_blocks, out, K):
    n = len(buf)
    m2 = np.uint64(0xBF58476D1CE4E5B9); m3 = np.uint64(0x94D049BB133111EB)
    b = 0
    while b < max_blocks:
        acc = np.uint64(0)
        prev = np.uint64(0)
        for k in range(block_size):
            if pos >= n:
                return b, pos
            c = buf[pos]
            if c == 0xCD:
                if pos + 2 >= n: return -1, pos
                v = (np.uint64(buf[pos + 1]) << np.uint64(8)) | np.uint64(buf[pos + 2]); pos += 3
            elif c == 0xCE:
                if pos + 4 >= n: return -1, pos
                v = (np.uint64(buf[pos + 1]) << np.uint64(24)) | (np.uint64(buf[pos + 2]) << np.uint64(16)) | (np.uint64(buf[pos + 3]) << np.uint64(8)) | np.uint64(buf[pos + 4]); pos += 5
            elif c < 0x80:
                v = np.uint64(c); pos += 1
            elif c == 0xCC:
                if pos + 1 >= n: return -1, pos
                v = np.uint64(buf[pos + 1]); pos += 2
            else:
                return -1, pos
            if k & 1:
                acc += (prev + K[k - 1]) * (v + K[k])
            else:
                prev = v
        if block_size & 1:
            acc += (prev + K[block_size - 1]) * K[block_size]
        h = acc ^ np.uint64(block_size)
        h = (h ^ (h >> np.uint64(30))) * m2
        h = (h ^ (h >> np.uint64(27))) * m3
        out[b] = h ^ (h >> np.uint64(31))
        b += 1
    return b, pos
parse_nh(buf,3,16,512,out,K)
def t(f,n=500):
    xs=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); xs.append(time.perf_counter()-t0)
    return round(statistics.median(xs)*1e6,2)
from indexer.hashing import _parse_blocks
_parse_blocks(buf,3,16,512,out)
for _ in range(2):
    print("old parse 512", t(lambda: _parse_blocks(buf, 3, 16, 512, out)))
    print("nh parse 512", t(lambda: parse_nh(buf, 3, 16, 512, out, K)))
    print("encode", t(lambda: enc(toks)))
