/* A server whose wall clock can be stepped while it runs (LD_PRELOAD).
 *
 * libfaketime cannot run redis-server: its jemalloc reads the clock while libfaketime
 * initialises itself (libfaketime issue #130). This shim needs no initialisation: it
 * adds the microseconds written in the file named by CLOCKSHIFT_FILE to CLOCK_REALTIME
 * (clock_gettime, gettimeofday, time), making raw system calls only. Monotonic clocks
 * are left alone, as a real clock step leaves them.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long shift_us(void) {
    const char *path = getenv("CLOCKSHIFT_FILE");
    char buf[32];
    long n;
    int fd;
    if (!path) return 0;
    fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY);
    if (fd < 0) return 0;
    n = syscall(SYS_read, fd, buf, sizeof buf - 1);
    syscall(SYS_close, fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    return atoll(buf);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long long ns;
    int r = (int)syscall(SYS_clock_gettime, id, ts);
    if (r != 0 || (id != CLOCK_REALTIME && id != CLOCK_REALTIME_COARSE)) return r;
    ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + shift_us() * 1000LL;
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
    return 0;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    clock_gettime(CLOCK_REALTIME, &ts);
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
