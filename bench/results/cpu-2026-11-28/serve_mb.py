import os, sys, re, urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository
from bench.serve_load import ours_args, serve_levels
from launch.local_server import LocalServer
from models import SHIPPED_MODEL

if __name__ == "__main__":
    for m in sys.argv[1:]:
        extra = [] if m == "auto" else ["--micro-batches", m]
        with LocalServer(SHIPPED_MODEL, nproc=2, args=ours_args((1, 1), 1 << 30) + extra) as srv:
            r = serve_levels(srv.url, [8, 64], 1, SHIPPED_MODEL)
            text = urllib.request.urlopen(srv.url + "/metrics").read().decode()
            mb = re.search(r"^afserve_micro_batches (\S+)", text, re.M).group(1)
            split = re.search(r"^afserve_micro_batched_steps_total (\S+)", text, re.M).group(1)
        print(f"mb={m} (gauge {mb}, split steps {split}): " + "; ".join(
            f"c={c} {x['tok_s']:.0f} tok/s TPOT p50 {x['tpot_p50']:.1f} TTFT p50 {x['ttft_p50']:.0f}" for c, x in r.items()),
            flush=True)
