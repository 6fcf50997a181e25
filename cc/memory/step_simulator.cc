// The memory planner's step simulator (StepSimulator.predict, tf_ucudnn/memory/cost/simulator.py)
// as a compiled loop, a Python extension through pybind11: the greedy search predicts thousands
// of sets of decisions for one step of tens of thousands of ops, and numpy spent most of each
// prediction in the overheads of calls over a few hundred values. What is modelled is said in
// simulator.py's docstring; the numpy code there stays the reference this is tested against.
// Times are the same sums in the same order as there, so the same doubles (built without
// contracting a * b + c into one rounding); bytes are exact integers.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace tf_ucudnn {
namespace {

namespace py = pybind11;

using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

template <typename T>
std::vector<T> ToVector(const py::array_t<T, py::array::c_style | py::array::forcecast>& array) {
  return std::vector<T>(array.data(), array.data() + array.size());
}

// The CPython calls themselves: a search reads a few hundred decisions' fields per prediction.
py::object Attribute(py::handle object, const py::object& name) {
  PyObject* value = PyObject_GetAttr(object.ptr(), name.ptr());
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

double AsDouble(const py::object& value) {
  const double number = PyFloat_AsDouble(value.ptr());
  if (number == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return number;
}

int64_t AsInt(const py::object& value) {
  const long long number = PyLong_AsLongLong(value.ptr());
  if (number == -1 && PyErr_Occurred()) throw py::error_already_set();
  return number;
}

bool Truthy(const py::object& value) {
  const int truth = PyObject_IsTrue(value.ptr());
  if (truth < 0) throw py::error_already_set();
  return truth;
}

[[noreturn]] void ThrowKeyError(py::handle key) {
  PyErr_SetObject(PyExc_KeyError, key.ptr());  // as a dict says it: KeyError('name')
  throw py::error_already_set();
}

py::object Interned(const char* text) {
  return py::reinterpret_steal<py::object>(PyUnicode_InternFromString(text));
}

// A per-row scratch array, each mark undone when the call that made it returns (or throws).
class RowMarks {
 public:
  explicit RowMarks(std::vector<int64_t>& marks) : marks_(marks) {}
  ~RowMarks() {
    for (int64_t row : rows_) marks_[row] = -1;
  }
  int64_t get(int64_t row) const { return marks_[row]; }
  void set(int64_t row, int64_t value) {
    if (marks_[row] < 0) rows_.push_back(row);
    marks_[row] = value;
  }

 private:
  std::vector<int64_t>& marks_;
  std::vector<int64_t> rows_;
};

// What a tuple of recomputations decides of a prediction, whatever is swapped (simulator.py's
// PreparedRecomputes), in the order the event loop and the peak read it.
struct PreparedRecomputes {
  struct BeforeOp {
    int64_t op;
    bool recompute;  // else a wait for the swap-in of tensor `row`, which one reads
    int64_t row;
    double cost_ms;
  };
  // By op: its waits, then its recomputations in the order they run.
  std::vector<BeforeOp> before;
  // The recomputed tensors' rows: those on their own in the order they run, then those made
  // with another, whose positions among the first are `owners`.
  std::vector<int64_t> rows;
  std::vector<int64_t> owners;
  struct Transient {
    int64_t position;  // among `rows`
    int64_t row;
    int64_t bytes;
    double ms;
  };
  std::vector<Transient> transients;
  double cost_ms = 0.0;
  py::dict due_by_name;  // as due_times gives it
};

// Where the event loop leaves the ops' times: each op's start is its prefix sum shifted by the
// waits before it, one shift from each op that waits (`delayed`, from op 0 on) to the next.
struct Shifts {
  std::vector<int64_t> delayed{0};
  std::vector<double> shifts{0.0};
};

// A span a tensor is held in, or a recomputation's transient tensor.
struct Piece {
  double start;
  double end;
  int64_t bytes;
  int64_t device;
};

class Step {
 public:
  Step(const DoubleArray& durations, const DoubleArray& prefix, const Int64Array& producers,
       const Int64Array& lasts, const Int64Array& sizes, const Int64Array& last_forward_uses,
       const Int64Array& backward_offsets, const Int64Array& backward_consumers,
       const Int64Array& devices, int64_t device_count, py::dict index, py::list names,
       double device_to_host, double host_to_device)
      : durations_(ToVector(durations)),
        prefix_(ToVector(prefix)),
        producers_(ToVector(producers)),
        lasts_(ToVector(lasts)),
        sizes_(ToVector(sizes)),
        last_forward_uses_(ToVector(last_forward_uses)),
        backward_offsets_(ToVector(backward_offsets)),
        backward_consumers_(ToVector(backward_consumers)),
        devices_(ToVector(devices)),
        device_count_(device_count),
        index_(std::move(index)),
        names_(std::move(names)),
        device_to_host_(device_to_host),
        host_to_device_(host_to_device),
        marks_(sizes_.size(), -1),
        due_marks_(sizes_.size(), -1),
        moved_(sizes_.size(), -1) {
    const size_t ops = durations_.size(), rows = sizes_.size();
    if (prefix_.size() != ops + 1 || producers_.size() != rows || lasts_.size() != rows ||
        last_forward_uses_.size() != rows || devices_.size() != rows ||
        backward_offsets_.size() != rows + 1 || static_cast<size_t>(py::len(names_)) != rows) {
      throw py::value_error("the step's arrays disagree in length");
    }
    for (size_t row = 0; row < rows; ++row) {
      CheckOp(producers_[row]);
      CheckOp(lasts_[row]);
      CheckOp(last_forward_uses_[row]);
      if (devices_[row] < 0 || devices_[row] >= device_count_) {
        throw py::value_error("a tensor's device is out of range");
      }
    }
    for (int64_t op : backward_consumers_) CheckOp(op);
    // As numpy's min: NaN if any is.
    for (double ms : durations_) shortest_ms_ = std::isnan(ms) ? ms : std::min(shortest_ms_, ms);
    // Per device, the bytes each op allocates and frees, were every tensor held from its
    // producer's start to its last reader's end, summed over the ops before each.
    std::vector<int64_t> allocated(ops);
    for (int64_t device = 0; device < device_count_; ++device) {
      DeviceOps& sums = device_ops_.emplace_back();
      std::fill(allocated.begin(), allocated.end(), 0);
      sums.freed.assign(ops, 0);
      for (size_t row = 0; row < rows; ++row) {
        if (devices_[row] != device) continue;
        allocated[producers_[row]] += sizes_[row];
        sums.freed[lasts_[row]] += sizes_[row];
      }
      sums.allocated_by.assign(ops + 1, 0);
      sums.freed_by.assign(ops + 1, 0);
      std::partial_sum(allocated.begin(), allocated.end(), sums.allocated_by.begin() + 1);
      std::partial_sum(sums.freed.begin(), sums.freed.end(), sums.freed_by.begin() + 1);
      for (size_t op = 0; op < ops; ++op) {
        sums.held.push_back(sums.allocated_by[op + 1] - sums.freed_by[op]);
      }
    }
  }

  // PreparedRecomputes.of: one pass over the decisions, then one over those on their own in
  // the order they run (by the op they run before, in the order given for the same op).
  PreparedRecomputes Prepare(const py::sequence& recomputes) {
    PreparedRecomputes made;
    RowMarks due(due_marks_), position(marks_);
    std::vector<Decision> decisions;
    std::vector<std::pair<int64_t, size_t>> running;  // first backward reader, place given
    std::vector<size_t> made_with;                     // places given
    std::vector<std::pair<py::object, int64_t>> due_reads;  // name, row
    for (py::handle given : recomputes) {
      py::object name = Attribute(given, attributes_.tensor);
      py::object reads = Attribute(given, attributes_.swapped_reads);
      Decision& decision = decisions.emplace_back();
      decision.row = Row(name);
      decision.cost_ms = AsDouble(Attribute(given, attributes_.cost_ms));
      decision.transient_bytes = AsInt(Attribute(given, attributes_.transient_bytes));
      decision.made_with = Attribute(given, attributes_.made_with);
      made.cost_ms += decision.cost_ms;  // in the order given, as sum() adds them
      const bool on_its_own = decision.made_with.is_none();
      if (on_its_own || Truthy(reads)) {
        const int64_t when = FirstBackward(decision.row, name);
        if (on_its_own) running.emplace_back(when, decisions.size() - 1);
        for (py::handle read : reads) {
          const int64_t read_row = Row(read);
          made.before.push_back({when, false, read_row, 0.0});
          const int64_t needed = due.get(read_row) >= 0 ? due.get(read_row)
                                                         : FirstBackward(read_row, read);
          if (due.get(read_row) < 0) {
            due_reads.emplace_back(py::reinterpret_borrow<py::object>(read), read_row);
          }
          due.set(read_row, std::min(needed, when));
        }
      }
      if (!on_its_own) made_with.push_back(decisions.size() - 1);
    }
    std::sort(running.begin(), running.end());
    for (size_t rank = 0; rank < running.size(); ++rank) {
      const Decision& decision = decisions[running[rank].second];
      made.before.push_back({running[rank].first, true, decision.row, decision.cost_ms});
      position.set(decision.row, rank);
      AddRow(made, decision);
    }
    // By op; at each, the waits (added first) come first and the recomputations keep the order
    // they run in.
    std::stable_sort(made.before.begin(), made.before.end(),
                     [](const PreparedRecomputes::BeforeOp& a,
                        const PreparedRecomputes::BeforeOp& b) { return a.op < b.op; });
    for (size_t given : made_with) {
      const Decision& decision = decisions[given];
      AddRow(made, decision);
      const int64_t owner = position.get(Row(decision.made_with));
      if (owner < 0) ThrowKeyError(decision.made_with);
      made.owners.push_back(owner);
    }
    for (const auto& [name, row] : due_reads) made.due_by_name[name] = due.get(row);
    return made;
  }

  // StepSimulator.predict's prediction, less what the caller adds: (step_ms, peak bytes without
  // the persistent ones, peak op, transfer_ms, copied_out_before, the peak's device index).
  py::tuple Predict(const py::sequence& swaps, const PreparedRecomputes& made) {
    const int64_t ops = durations_.size();
    // The swaps, one per tensor (as a dict keeps them: the first's place, the last's prefetch).
    RowMarks position(marks_);
    std::vector<Swap> chosen;
    for (py::handle swap : swaps) {
      py::object name = Attribute(swap, attributes_.tensor);
      const int64_t row = Row(name);
      const int64_t prefetch_after = AsInt(Attribute(swap, attributes_.prefetch_after));
      if (position.get(row) >= 0) {
        chosen[position.get(row)].prefetch_after = prefetch_after;
      } else {
        position.set(row, chosen.size());
        chosen.push_back({row, prefetch_after, std::move(name)});
      }
    }
    const int64_t swapped = chosen.size();

    // The event loop, as simulator.py's: only the ops that wait, or start or end a transfer
    // or a recomputation, are looked at; the others run back to back.
    std::vector<SwapEvent> events;
    for (int64_t j = 0; j < swapped; ++j) {
      const int64_t row = chosen[j].row;
      for (int64_t k = backward_offsets_[row]; k < backward_offsets_[row + 1]; ++k) {
        events.push_back({backward_consumers_[k], SwapEvent::kWait, j});
      }
      events.push_back({producers_[row], SwapEvent::kCopyOut, j});
      events.push_back({CheckOp(chosen[j].prefetch_after), SwapEvent::kCopyIn, j});
    }
    std::sort(events.begin(), events.end(), [](const SwapEvent& a, const SwapEvent& b) {
      return a.op != b.op ? a.op < b.op : a.kind != b.kind ? a.kind < b.kind : a.swap < b.swap;
    });
    Shifts waited;
    std::vector<double> out_done(swapped), in_start(swapped), in_done(swapped);
    std::vector<char> out_set(swapped), in_set(swapped);
    std::vector<double> recomputed_at;
    double shift = 0.0, d2h_free = 0.0, h2d_free = 0.0, transfer = 0.0;
    const auto& before = made.before;
    size_t b = 0, e = 0;
    while (b < before.size() || e < events.size()) {
      const int64_t i = CheckOp(std::min(b < before.size() ? before[b].op : ops,
                                         e < events.size() ? events[e].op : ops));
      const double clock = prefix_[i] + shift;
      double ready = clock;
      for (; b < before.size() && before[b].op == i && !before[b].recompute; ++b) {
        const int64_t j = position.get(before[b].row);
        if (j < 0 || !in_set[j]) ThrowKeyError(names_[before[b].row]);
        if (in_done[j] > ready) ready = in_done[j];
      }
      for (; e < events.size() && events[e].op == i && events[e].kind == SwapEvent::kWait; ++e) {
        const int64_t j = events[e].swap;
        if (!in_set[j]) ThrowKeyError(chosen[j].name);
        if (in_done[j] > ready) ready = in_done[j];
      }
      for (; b < before.size() && before[b].op == i; ++b) {
        recomputed_at.push_back(ready);
        ready += before[b].cost_ms;
      }
      if (ready != clock) {
        shift += ready - clock;
        waited.delayed.push_back(i);
        waited.shifts.push_back(shift);
      }
      const double end_i = ready + durations_[i];
      for (; e < events.size() && events[e].op == i && events[e].kind == SwapEvent::kCopyOut;
           ++e) {
        const int64_t j = events[e].swap;
        const double copy = static_cast<double>(sizes_[chosen[j].row]) / device_to_host_ * 1e3;
        out_done[j] = d2h_free = std::max(d2h_free, end_i) + copy;
        out_set[j] = true;
        transfer += copy;
      }
      for (; e < events.size() && events[e].op == i; ++e) {
        const int64_t j = events[e].swap;
        if (!out_set[j]) ThrowKeyError(chosen[j].name);
        const double copy = static_cast<double>(sizes_[chosen[j].row]) / host_to_device_ * 1e3;
        const double begin = std::max(std::max(h2d_free, end_i), out_done[j]);
        in_start[j] = begin;
        in_done[j] = begin + copy;
        in_set[j] = true;
        h2d_free = begin + copy;
        transfer += copy;
      }
    }
    // A tensor made with another is recomputed when that one is.
    for (int64_t owner : made.owners) recomputed_at.push_back(recomputed_at[owner]);
    SetStarts(waited);

    // The swapped and recomputed tensors are held in two pieces each (and a recomputation's
    // transient tensor briefly), in place of their whole lives.
    std::vector<int64_t> moved;
    for (const Swap& swap : chosen) moved.push_back(swap.row);
    moved.insert(moved.end(), made.rows.begin(), made.rows.end());
    std::vector<Piece> pieces;
    for (size_t k = 0; k < moved.size(); ++k) {  // until the last forward use (or copy out)
      const int64_t row = moved[k];
      double until = End(last_forward_uses_[row]);
      if (static_cast<int64_t>(k) < swapped) until = std::max(until, out_done[k]);
      pieces.push_back({start_[producers_[row]], until, sizes_[row], devices_[row]});
    }
    // From the swap-in or recomputation on, until the last reader (a recomputation reading a
    // swapped tensor is due no later than its first reader: numpy's maximum of the two is the
    // last reader).
    for (size_t k = 0; k < moved.size(); ++k) {
      const int64_t row = moved[k];
      const double from = static_cast<int64_t>(k) < swapped ? in_start[k]
                                                             : recomputed_at[k - swapped];
      pieces.push_back({from, End(lasts_[row]), sizes_[row], devices_[row]});
    }
    for (const auto& transient : made.transients) {
      const double from = recomputed_at[transient.position];
      pieces.push_back({from, from + transient.ms, transient.bytes, devices_[transient.row]});
    }

    // Where every op takes far longer than the rounding of the times (OpStartPeaks.in_order),
    // the ops start and end in order, each after the one before it ends but for an ulp or so.
    const double step_ms = ops ? End(ops - 1) : 0.0;
    const bool in_order = ops && shortest_ms_ > std::fabs(step_ms) * 0x1p-44;
    const bool ends_sorted = in_order || SetEnds();
    RowMarks moved_marks(moved_);
    for (int64_t row : moved) moved_marks.set(row, 1);
    int64_t peak = 0, peak_device = 0;
    double peak_time = 0.0;
    for (int64_t device = 0; device < device_count_; ++device) {
      const Changes changes = DeviceChanges(device, moved, pieces);
      std::pair<int64_t, double> found = in_order ? PeakInOrder(device, changes)
                                                  : PeakOutOfOrder(device, changes, ends_sorted);
      if (found.first <= 0) found = NothingHeld(device, pieces);
      // The highest peak wins, as max() over (peak, time, device) picks.
      const auto [bytes, time] = found;
      if (device == 0 || bytes > peak || (bytes == peak && time >= peak_time)) {
        peak = bytes;
        peak_time = time;
        peak_device = device;
      }
    }
    // The op running at the peak or, in a wait or recomputation before an op, that op.
    int64_t running = ops;
    if (in_order) {
      int64_t low = 0;
      while (low < running) {  // the first op to end after the peak (the ends are in order)
        const int64_t middle = (low + running) / 2;
        if (End(middle) <= peak_time) low = middle + 1; else running = middle;
      }
    } else if (ends_sorted) {
      running = std::upper_bound(end_.begin(), end_.end(), peak_time) - end_.begin();
    } else {
      running = std::find_if(end_.begin(), end_.end(),
                             [peak_time](double end) { return peak_time < end; }) - end_.begin();
    }
    // Per swapped tensor, the first op to start after its copy out ends.
    py::tuple copied_out_before(swapped);
    for (int64_t j = 0; j < swapped; ++j) {
      const int64_t row = chosen[j].row;
      if (backward_offsets_[row] == backward_offsets_[row + 1]) {
        throw py::index_error("a swapped tensor has no backward reader");
      }
      const int64_t after =
          std::lower_bound(start_.begin(), start_.end(), out_done[j] - 1e-9) - start_.begin();
      const int64_t op = std::min(std::max(after, last_forward_uses_[row] + 1),
                                  backward_consumers_[backward_offsets_[row]]);
      copied_out_before[j] = py::make_tuple(chosen[j].name, op);
    }
    return py::make_tuple(step_ms, peak, std::min(running, ops - 1), transfer,
                          copied_out_before, peak_device);
  }

 private:
  struct DeviceOps {
    std::vector<int64_t> freed;         // per op, of the tensors it reads last
    std::vector<int64_t> allocated_by;  // by ops 0..i-1 (ops + 1 sums)
    std::vector<int64_t> freed_by;
    std::vector<int64_t> held;  // at op i's start, op i-1 ended: allocated_by[i + 1] - freed_by[i]
  };
  struct Decision {  // a RecomputeDecision's fields, read once
    int64_t row;
    double cost_ms;
    int64_t transient_bytes;
    py::object made_with;
  };
  struct Swap {
    int64_t row;
    int64_t prefetch_after;
    py::object name;
  };
  struct SwapEvent {
    enum Kind { kWait, kCopyOut, kCopyIn };  // the order the loop takes them at one op
    int64_t op;
    Kind kind;
    int64_t swap;  // its place among the swaps
  };
  struct AttributeNames {
    py::object tensor = Interned("tensor"), prefetch_after = Interned("prefetch_after"),
               cost_ms = Interned("cost_ms"), swapped_reads = Interned("swapped_reads"),
               made_with = Interned("made_with"), transient_bytes = Interned("transient_bytes");
  };
  // A change of the bytes held at a time of its own: a piece's start or end, a moved tensor's
  // producer's start or last reader's end.
  struct Change {
    double time;
    int64_t bytes;
    bool piece_start;
  };
  using Changes = std::vector<Change>;

  int64_t CheckOp(int64_t op) const {
    if (op < 0 || op >= static_cast<int64_t>(durations_.size())) {
      throw py::index_error("an op index is out of range");
    }
    return op;
  }

  int64_t Row(py::handle name) const {
    PyObject* row = PyDict_GetItemWithError(index_.ptr(), name.ptr());
    if (row == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      ThrowKeyError(name);
    }
    return AsInt(py::reinterpret_borrow<py::object>(row));
  }

  int64_t FirstBackward(int64_t row, py::handle name) const {
    if (backward_offsets_[row] == backward_offsets_[row + 1]) ThrowKeyError(name);
    return backward_consumers_[backward_offsets_[row]];
  }

  // A recomputed tensor's row, next among `made.rows`, and its transient tensor if any.
  static void AddRow(PreparedRecomputes& made, const Decision& decision) {
    if (decision.transient_bytes) {
      made.transients.push_back({static_cast<int64_t>(made.rows.size()), decision.row,
                                 decision.transient_bytes, decision.cost_ms});
    }
    made.rows.push_back(decision.row);
  }

  // The ops' starts, the prefix sums shifted by the waits before them (the same sums as
  // numpy's), each op's end its start plus its time.
  void SetStarts(const Shifts& waited) {
    const int64_t ops = durations_.size();
    start_.resize(ops);
    for (size_t k = 0; k < waited.delayed.size(); ++k) {
      const int64_t until = k + 1 < waited.delayed.size() ? waited.delayed[k + 1] : ops;
      const double shift = waited.shifts[k];
      for (int64_t op = waited.delayed[k]; op < until; ++op) start_[op] = prefix_[op] + shift;
    }
  }
  double End(int64_t op) const { return start_[op] + durations_[op]; }

  // The ops' ends as an array, for the sweeps that take the times in any order; whether they
  // are in order.
  bool SetEnds() {
    end_.resize(start_.size());
    bool ends_sorted = true;
    for (size_t op = 0; op < start_.size(); ++op) {
      end_[op] = End(op);
      ends_sorted &= op == 0 || end_[op - 1] <= end_[op];
    }
    return ends_sorted;
  }

  // The changes of one device's bytes held at times of their own, in time order: the pieces
  // held (ending after they start, as in the sweep), and the moved tensors, each taken out of
  // the ops' sums from its producer's start to its last reader's end. `pieces` are Predict's:
  // each moved tensor's first piece, then each's second, then the transient tensors. The
  // pieces' starts are the candidates for the peak.
  Changes DeviceChanges(int64_t device, const std::vector<int64_t>& moved,
                        const std::vector<Piece>& pieces) const {
    Changes changes;
    for (size_t k = 0; k < moved.size(); ++k) {
      const int64_t row = moved[k];
      if (devices_[row] != device) continue;
      // Its first piece starts as it is taken out, at its producer's start (and ends no
      // earlier), and its second ends at its last reader's end, as it would have: what is left
      // is a gap from the first's end to the second's start (or to the end, the second not
      // held).
      const Piece& second = pieces[moved.size() + k];
      const bool held_again = second.end > second.start;
      changes.push_back({pieces[k].end, -sizes_[row], false});
      changes.push_back({held_again ? second.start : second.end, sizes_[row], held_again});
    }
    for (size_t k = 2 * moved.size(); k < pieces.size(); ++k) {  // the transient tensors
      const Piece& piece = pieces[k];
      if (piece.device != device || !(piece.end > piece.start)) continue;
      changes.push_back({piece.start, piece.bytes, true});
      changes.push_back({piece.end, -piece.bytes, false});
    }
    std::sort(changes.begin(), changes.end(),
              [](const Change& a, const Change& b) { return a.time < b.time; });
    return changes;
  }

  // One device's most bytes held at once and when, as simulator.py's swept_peak finds them over
  // the tensors not moved (held from their producer's start to their last reader's end) and the
  // pieces: held in half-open [start, end) spans, at equal times freed before allocated, the
  // earliest time of the most; 0 where nothing is held (NothingHeld then says when).
  //
  // The bytes held at a time T are those allocated by T less those freed by T: the ops' sums
  // over the ops started and ended by T, with every tensor whole, plus the changes by T. Their
  // most is first reached at an allocation, an op's start or a piece's: one pass over those in
  // time order gives the sweep's peak without sorting every tensor.
  //
  // This one where the ops are in order: by op i's start, ops 0..i have started and ops 0..i-2
  // ended (each takes far longer than an ulp), op i-1 too unless it ends an ulp late.
  std::pair<int64_t, double> PeakInOrder(int64_t device, const Changes& changes) const {
    const DeviceOps& sums = device_ops_[device];
    const int64_t ops = durations_.size();
    const double* start = start_.data();
    const double* duration = durations_.data();
    const int64_t* held = sums.held.data();
    const int64_t* freed = sums.freed.data();
    const double never = std::numeric_limits<double>::infinity();
    double end_last = never;  // the end of the last op started
    int64_t op = 0, changed = 0, freed_last = 0, most = 0;
    double most_at = 0.0;
    for (size_t k = 0;;) {
      // The ops starting before the next change: the bytes held at their starts.
      const double until = k < changes.size() ? changes[k].time : never;
      for (; op < ops && start[op] < until; ++op) {
        const double at = start[op];
        const int64_t bytes = held[op] + changed + (end_last > at ? freed_last : 0);
        if (bytes > most) {
          most = bytes;
          most_at = at;
        }
        end_last = at + duration[op];
        freed_last = freed[op];
      }
      if (k == changes.size()) break;
      bool allocates = false;
      for (; k < changes.size() && changes[k].time == until; ++k) {
        changed += changes[k].bytes;
        allocates |= changes[k].piece_start;
      }
      // A piece starting between two ops' starts: ops 0..op-1 have started, and all but the
      // last few ended (the ends are in order).
      if (allocates && !(op < ops && start[op] == until)) {
        int64_t ended = op;
        while (ended > 0 && End(ended - 1) > until) --ended;
        const int64_t bytes = sums.allocated_by[op] - sums.freed_by[ended] + changed;
        if (bytes > most) {
          most = bytes;
          most_at = until;
        }
      }
    }
    return {most, most_at};
  }

  // PeakInOrder's, where the ops' times are not surely in order (some take no time): by
  // counting the ops started and ended by each time, the ends in time order (`ends_sorted`,
  // else sorted here).
  std::pair<int64_t, double> PeakOutOfOrder(int64_t device, const Changes& changes,
                                            bool ends_sorted) const {
    const DeviceOps& sums = device_ops_[device];
    const int64_t ops = durations_.size();
    std::vector<double> piece_starts;
    for (const Change& change : changes) {
      if (change.piece_start) piece_starts.push_back(change.time);
    }
    // Bytes freed by the first k ops to end, in the order they end.
    const std::vector<int64_t>* freed_by = &sums.freed_by;
    const std::vector<double>* ends = &end_;
    std::vector<int64_t> freed_by_end;
    std::vector<double> sorted_ends;
    if (!ends_sorted) {
      std::vector<int64_t> order(ops);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [this](int64_t a, int64_t b) { return end_[a] < end_[b]; });
      freed_by_end.assign(ops + 1, 0);
      for (int64_t k = 0; k < ops; ++k) {
        sorted_ends.push_back(end_[order[k]]);
        freed_by_end[k + 1] = freed_by_end[k] + sums.freed[order[k]];
      }
      freed_by = &freed_by_end;
      ends = &sorted_ends;
    }
    int64_t started = 0, ended = 0, changed = 0, most = 0;
    size_t change = 0, piece = 0;
    double most_at = 0.0;
    const auto look_at = [&](double time) {
      while (started < ops && start_[started] <= time) ++started;
      while (ended < ops && (*ends)[ended] <= time) ++ended;
      for (; change < changes.size() && changes[change].time <= time; ++change) {
        changed += changes[change].bytes;
      }
      const int64_t held = sums.allocated_by[started] - (*freed_by)[ended] + changed;
      if (held > most) {
        most = held;
        most_at = time;
      }
    };
    for (int64_t op = 0; op < ops; ++op) {
      for (; piece < piece_starts.size() && piece_starts[piece] < start_[op]; ++piece) {
        look_at(piece_starts[piece]);
      }
      look_at(start_[op]);
    }
    for (; piece < piece_starts.size(); ++piece) look_at(piece_starts[piece]);
    return {most, most_at};
  }

  // swept_peak's answer where the sweeps find no byte held: 0, at the earliest time a span
  // (of no bytes) is held, or 0.0 where none is.
  std::pair<int64_t, double> NothingHeld(int64_t device, const std::vector<Piece>& pieces) const {
    double first = std::numeric_limits<double>::infinity();
    for (size_t row = 0; row < sizes_.size(); ++row) {
      if (moved_[row] >= 0 || devices_[row] != device) continue;
      const double start = start_[producers_[row]];
      if (End(lasts_[row]) > start) first = std::min(first, start);
    }
    for (const Piece& piece : pieces) {
      if (piece.device == device && piece.end > piece.start) first = std::min(first, piece.start);
    }
    return {0, first == std::numeric_limits<double>::infinity() ? 0.0 : first};
  }

  const std::vector<double> durations_, prefix_;
  const std::vector<int64_t> producers_, lasts_, sizes_, last_forward_uses_;
  // Each tensor's backward readers, in order: those of row r at [offsets[r], offsets[r + 1]).
  const std::vector<int64_t> backward_offsets_, backward_consumers_;
  const std::vector<int64_t> devices_;
  const int64_t device_count_;
  const py::dict index_;  // name -> row
  const py::list names_;
  const double device_to_host_, host_to_device_;
  const AttributeNames attributes_;
  double shortest_ms_ = std::numeric_limits<double>::infinity();
  std::vector<DeviceOps> device_ops_;
  // Scratch of one call at a time (the GIL is held throughout): per row, unmarked as -1.
  std::vector<int64_t> marks_, due_marks_, moved_;
  std::vector<double> start_, end_;  // the ops' times, where a sweep needs them as arrays
};

}  // namespace
}  // namespace tf_ucudnn

PYBIND11_MODULE(_step_simulator, module) {
  namespace py = pybind11;
  using tf_ucudnn::DoubleArray;
  using tf_ucudnn::Int64Array;
  using tf_ucudnn::PreparedRecomputes;
  using tf_ucudnn::Step;
  module.doc() = "StepSimulator.predict's inner loop, compiled (cc/memory/step_simulator.cc).";
  py::class_<PreparedRecomputes>(module, "PreparedRecomputes")
      .def_readonly("cost_ms", &PreparedRecomputes::cost_ms)
      .def_readonly("due", &PreparedRecomputes::due_by_name);
  py::class_<Step>(module, "Step")
      .def(py::init<const DoubleArray&, const DoubleArray&, const Int64Array&, const Int64Array&,
                    const Int64Array&, const Int64Array&, const Int64Array&, const Int64Array&,
                    const Int64Array&, int64_t, py::dict, py::list, double, double>(),
           py::arg("durations"), py::arg("prefix"), py::arg("producers"), py::arg("lasts"),
           py::arg("sizes"), py::arg("last_forward_uses"), py::arg("backward_offsets"),
           py::arg("backward_consumers"), py::arg("devices"), py::arg("device_count"),
           py::arg("index"), py::arg("names"), py::arg("device_to_host"),
           py::arg("host_to_device"))
      .def("prepare", &Step::Prepare, py::arg("recomputes"))
      .def("predict", &Step::Predict, py::arg("swaps"), py::arg("made"));
}
