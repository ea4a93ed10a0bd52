/* LD_PRELOAD shim for the benchmark's "slow WAL device" (bench/slowflush.py):
 * every fsync/fdatasync first sleeps FSYNC_DELAY_US microseconds (default
 * 1000), then does the real call: a cloud volume's flush latency on a local
 * disk. Built by bench/slowflush.py with `cc -shared -fPIC -O2 -ldl`. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

static long delay_ns = -1;

static void wait_a_flush(void) {
    if (delay_ns < 0) {
        const char *v = getenv("FSYNC_DELAY_US");
        delay_ns = (v ? atol(v) : 1000) * 1000L;
    }
    if (delay_ns > 0) {
        struct timespec ts = {delay_ns / 1000000000L, delay_ns % 1000000000L};
        nanosleep(&ts, NULL);
    }
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    wait_a_flush();
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    wait_a_flush();
    return real(fd);
}
