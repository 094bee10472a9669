set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
SPY=/tmp/site/bin/py-spy
ls /tmp/site/bin
export PYTHONUNBUFFERED=1
MB=1 SECS=45 python3 .scratch/prof.py > $OUT/run.log 2>&1 &
for i in $(seq 120); do [ -s $OUT/pids.txt ] && break; sleep 1; done
sleep 6
read -r LEAD W0 W1 < $OUT/pids.txt
echo "pids $LEAD $W0 $W1"; ps -o pid,ppid,pcpu,cmd --ppid $LEAD | cut -c1-150
$SPY record --idle -r 200 -d 15 -f raw -o $OUT/lead.txt --pid $LEAD > $OUT/spy0.log 2>&1 &
$SPY record --idle -r 200 -d 15 -f raw -o $OUT/w0.txt --pid $W0 > $OUT/spy1.log 2>&1 &
$SPY record --idle -r 200 -d 15 -f raw -o $OUT/w1.txt --pid $W1 > $OUT/spy2.log 2>&1 &
wait
tail -5 $OUT/run.log; tail -3 $OUT/spy*.log; ls -la $OUT
