# Shell functions the benchmarks source to read `train`'s output.

# The median of the numbers on standard input, one per line ("-" for none).
median() {
  sort -n | awk '{ v[NR] = $1 } END { if (NR == 0) print "-"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# The median ms/step of the steps after the first that LOG (train's output with --log_every=1) reports.
median_step_ms() {
  sed -n 's/.*step \([0-9]*\)\/.* \([0-9.]*\) ms\/step.*/\1 \2/p' "$1" | awk '$1 > 1 { print $2 }' | median
}

# The largest rank's peak resident MB that LOG's last line reports ("-" if none).
peak_rss_mb() {
  sed -n 's/.*done: .* peak RSS \([0-9]*\) MB.*/\1/p' "$1" | tail -1 | grep . || echo -
}
