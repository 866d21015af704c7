/* The pod sandbox's one process (what Kubernetes' pause image does): hold the pod's
 * namespaces, reap orphaned children, exit at SIGINT/SIGTERM. Built static by images/build.sh
 * into kvship/pause:3.6, the sandbox image of the end-to-end cluster (.ci/e2e.sh), so that no
 * registry is needed. */
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction a = {0};
    sigemptyset(&a.sa_mask);
    a.sa_handler = quit;
    sigaction(SIGINT, &a, NULL);
    sigaction(SIGTERM, &a, NULL);
    a.sa_handler = reap;
    a.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &a, NULL);
    for (;;) pause();
    return 0;
}
