// rank_info(): where this process stands among the ranks. The launcher is recognised from the
// environment it sets (Open MPI's mpirun, PMIx, PMI2, srun); only then is MPI initialised, so a
// plain `headroom train` needs no MPI at all, and a build without MPI still runs at world size 1.
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "core/comm/comm.h"
#include "core/comm/comm_impl.h"

#if HEADROOM_HAVE_MPI
#include <mpi.h>
#endif

namespace headroom {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return end != v && *end == '\0' && x >= 0 && x <= INT_MAX ? int(x) : fallback;
}

// Which launcher started this process, or nullptr. Slurm sets SLURM_PROCID in a batch script too
// (the batch step, id 0xfffffffe): only a task of an srun step (SLURM_STEP_ID) counts as launched.
const char* detect_launcher() {
  if (env("OMPI_COMM_WORLD_SIZE") != nullptr) return "mpirun";
  if (env("PMIX_RANK") != nullptr) return "PMIx";
  if (env("PMI_RANK") != nullptr) return "PMI";
  const char* step = env("SLURM_STEP_ID");
  if (env("SLURM_PROCID") != nullptr && env("SLURM_NTASKS") != nullptr && step != nullptr &&
      std::strcmp(step, "4294967294") != 0)
    return "srun";
  return nullptr;
}

std::string local_host_name() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

#if HEADROOM_HAVE_MPI
// MPI is finalised at exit, after every communicator (each frees its MPI objects in its destructor
// and checks MPI_Finalized first, in case one outlives this).
// After a collective timed out or was stopped with a peer missing (mpi_unusable), that peer may
// be dead, and MPI_Finalize's fence over every process would wait for it forever: a watchdog ends
// the process with the exit code of a run stopped by another rank (6) if it has not returned
// within a few seconds.
void finalize_mpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (comm_detail::mpi_unusable())
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      std::_Exit(6);
    }).detach();
  MPI_Finalize();
}

RankInfo launched_ranks(const char* launcher) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // FUNNELED: only the training thread calls MPI (the loader's workers never do).
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      throw CommError(std::string("MPI_Init_thread failed (launched by ") + launcher + ")", -1);
    std::atexit(finalize_mpi);
    if (provided < MPI_THREAD_FUNNELED)
      throw CommError("MPI does not offer MPI_THREAD_FUNNELED (it offers level " +
                          std::to_string(provided) + ")",
                      -1);
  }
  // Errors come back as codes (CommError) instead of aborting the job inside MPI.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  RankInfo info;
  info.launched = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &info.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &info.world_size);
  // The ranks sharing this host's memory: MPI knows them whichever launcher ran us.
  MPI_Comm local = MPI_COMM_NULL;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, info.rank, MPI_INFO_NULL, &local) ==
      MPI_SUCCESS) {
    MPI_Comm_rank(local, &info.local_rank);
    MPI_Comm_size(local, &info.local_size);
    MPI_Comm_free(&local);
  } else {
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", env_int("SLURM_LOCALID", 0));
    info.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  }
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS && len > 0)
    info.host.assign(name, size_t(len));
  else
    info.host = local_host_name();
  return info;
}
#endif

RankInfo detect() {
  const char* launcher = detect_launcher();
  if (launcher == nullptr) {
    RankInfo info;
    info.host = local_host_name();
    return info;
  }
#if HEADROOM_HAVE_MPI
  return launched_ranks(launcher);
#else
  // Without MPI the ranks cannot talk: the launcher's own numbers, so that make_communicator can
  // refuse a multi-rank run by name instead of every rank training alone as rank 0.
  RankInfo info;
  info.launched = true;
  info.rank = env_int("OMPI_COMM_WORLD_RANK",
                      env_int("PMIX_RANK", env_int("PMI_RANK", env_int("SLURM_PROCID", 0))));
  info.world_size =
      env_int("OMPI_COMM_WORLD_SIZE", env_int("PMI_SIZE", env_int("SLURM_NTASKS", 1)));
  info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", env_int("SLURM_LOCALID", 0));
  info.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  info.host = local_host_name();
  return info;
#endif
}

}  // namespace

const RankInfo& rank_info() {
  // Once per process; a failure to initialise MPI is rethrown to every later caller.
  static std::once_flag once;
  static RankInfo info;
  static std::string error;
  std::call_once(once, [] {
    try {
      info = detect();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  if (!error.empty()) throw CommError(error, -1);
  return info;
}

}  // namespace headroom
