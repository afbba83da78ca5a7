import time, statistics, random, msgspec, numpy as np
from indexer.hashing import content_hashes, _parse_blocks, warmup
warmup()
toks=[random.randrange(128000) for _ in range(8192)]
def t(f,n=500):
    xs=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); xs.append(time.perf_counter()-t0)
    return round(statistics.median(xs)*1e6,2)
enc=msgspec.msgpack.Encoder().encode
raw=enc(toks); buf=np.frombuffer(raw,dtype=np.uint8); out=np.empty(512,dtype=np.uint64)
for _ in range(2):
    print("tuple hash 512", t(lambda: list(map(hash, zip(*[iter(toks)]*16)))))
    print("encode 8192", t(lambda: enc(toks)))
    print("parse 512", t(lambda: _parse_blocks(buf, 3, 16, 512, out)))
    print("parse 1 blk", t(lambda: _parse_blocks(buf, 3, 16, 1, out)))
    print("content_hashes 512", t(lambda: content_hashes(toks,16)))
    print("sum", t(lambda: sum(toks)))
