// Stopping a run on SIGINT / SIGTERM without losing work.
//
// The first signal only asks: the trainer stops at its next safe point (the end of a micro-step),
// writes what the run has (metrics, timeline, trace, a final snapshot) and throws Interrupted. A
// second signal ends the process at once (exit 128 + signal); files written through AtomicFile
// are then either complete or absent, so the previous snapshot stays loadable.
#pragma once

#include <stdexcept>
#include <string>

namespace headroom {

// Installs the handlers for SIGINT and SIGTERM (the host does, before a run).
void install_stop_handlers();

// The signal that asked the run to stop, or 0. Async-signal-safe to set, cheap to read.
int stop_signal();
// Asks for a stop as a signal would (tests, embedding hosts). `signal` is SIGINT or SIGTERM.
void request_stop(int signal);
// Forgets a stop request (a host that runs again after an interrupted run).
void clear_stop();

// "SIGINT", "SIGTERM", or "signal N".
std::string signal_name(int signal);

// Thrown by Trainer::run once an interrupted run has written what it has.
class Interrupted : public std::runtime_error {
 public:
  Interrupted(int signal, const std::string& what)
      : std::runtime_error(what), signal_(signal), exit_code_(128 + signal) {}
  int signal() const { return signal_; }  // 0 for a stop no signal asked for
  // 128 + signal: 130 for SIGINT, 143 for SIGTERM, as shells report them; a stop of another
  // origin (a plugin's, core/run/run_control.h) has its own.
  int exit_code() const { return exit_code_; }

 protected:
  Interrupted(int signal, int exit_code, const std::string& what)
      : std::runtime_error(what), signal_(signal), exit_code_(exit_code) {}

 private:
  int signal_;
  int exit_code_;
};

}  // namespace headroom
