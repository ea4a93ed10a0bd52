/* A stand-in for a cloud volume: every fdatasync/fsync of the process waits
 * SLOWSYNC_US microseconds (default 1000) before the real call.
 * Built by the benchmark (bench/checkout.py) with `cc -shared -fPIC` into .tmp/
 * and loaded into the PostgreSQL server with LD_PRELOAD; never committed built. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

static void wait_for_the_volume(void) {
  static long ns = -1;
  if (ns < 0) {
    const char *us = getenv("SLOWSYNC_US");
    ns = (us ? atol(us) : 1000) * 1000L;
  }
  struct timespec t = {ns / 1000000000L, ns % 1000000000L};
  nanosleep(&t, NULL);
}

int fdatasync(int fd) {
  static int (*real)(int);
  if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
  wait_for_the_volume();
  return real(fd);
}

int fsync(int fd) {
  static int (*real)(int);
  if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
  wait_for_the_volume();
  return real(fd);
}
