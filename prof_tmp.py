import argparse, time, cProfile, pstats, statistics
from kvrouter.bench import indexer_bench as b
from indexer import Indexer
from indexer.hashing import content_hashes, chain
ap=argparse.ArgumentParser(); b.add_args(ap); a=ap.parse_args(['--no-peer'])
w=b.build(a)
ix=Indexer(16)
for inst,p,_ in w["stored"]: ix.apply_payload(inst,p)
for inst,p,_ in w["removed"]: ix.apply_payload(inst,p)
qs=[q for k,q in w["queries"] if k=="hit_prefix"]
def t(f, xs):
    r=[]
    for x in xs:
        t0=time.perf_counter(); f(x); r.append(time.perf_counter()-t0)
    return round(statistics.median(r)*1e6,1)
for _ in range(2):
    print("lookup", t(ix.lookup, qs))
    print("content 32", t(lambda q: content_hashes(q,16,0,32), qs))
    print("content 64 @32", t(lambda q: content_hashes(q,16,32,64), qs))
    print("content 512", t(lambda q: content_hashes(q,16), qs))
    ch=[ix.chain_hashes(q)[:200] for q in qs]
    print("match 200", t(ix.index.match, ch))
    print("chain 200", t(lambda c: chain(c, 0), ch))
    ms=[ix.index.match(c) for c in ch]
    print("result", t(lambda m: ix._result(8192, m), ms))
    print("held_by_any", t(lambda c: ix.index.held_by_any(int(c[5])), ch))
pr=cProfile.Profile(); pr.enable()
for q in qs: ix.lookup(q)
pr.disable(); pstats.Stats(pr).sort_stats('tottime').print_stats(14)
