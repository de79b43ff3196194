# The bytes of one tracker category in a recorder test plugin's events file (alloc_events = true):
# what is live at the end and its peak, from every ALLOC and FREE line.
#
#   awk -v c=CATEGORY -f tests/mpi/tally.awk EVENTS    -> "live_at_end peak"
#
# CATEGORY is hr_mem_category's number: 0 parameters, 1 gradients, 2 optimizer, 6 communication.
# With -v from=EVENT (TRAIN_BEGIN) the peak counts only from that event's line on; with
# -v at=EVENT (STEP_END) a third field lists the distinct live bytes at that event's lines.
from != "" && $2 == from && !counting { counting = 1; peak = live }
at != "" && $2 == at { if (!((live + 0) in seen)) { seen[live + 0] = 1; at_values = at_values (at_values == "" ? "" : ",") live + 0 } }
/ ALLOC / || / FREE / {
  b = 0; k = -1
  for (i = 1; i <= NF; i++) {
    if ($i ~ /^bytes=/) b = substr($i, 7)
    if ($i ~ /^category=/) k = substr($i, 10)
  }
  if (k != c) next
  if ($0 ~ / ALLOC /) live += b; else live -= b
  if ((from == "" || counting) && live > peak) peak = live
}
END { print live + 0, peak + 0, (at_values == "" ? "-" : at_values) }
