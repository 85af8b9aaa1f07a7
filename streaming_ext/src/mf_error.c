// The streamer's error record: nothing in the library aborts on an error.
//
// A failure anywhere (a lane's read, a buffer callback, a route) is recorded here: the first one
// since the last mf_error_take is kept with its message (under s->mu, which the lanes also hold
// when they record a failed read), and every one is counted. The routing callback checks
// mf_error_pending and stops the graph; mf_streamer_take_error hands the error to Python, which
// fails that request with it.
#include "mf_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>

void mf_error_record_locked(mf_streamer * s, int code, const char * msg) {
    if (s->err_code == 0) {
        s->err_code = code ? code : -EIO;
        snprintf(s->err_msg, sizeof s->err_msg, "%s", msg);
    }
}

void mf_streamer_fail(mf_streamer * s, int code, const char * fmt, ...) {
    char    msg[MF_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&s->mu);
    mf_error_record_locked(s, code, msg);
    snprintf(s->last_error, sizeof s->last_error, "%s", msg);
    pthread_mutex_unlock(&s->mu);
    ADD(s->st.errors, 1);
}

bool mf_error_pending(mf_streamer * s) {
    pthread_mutex_lock(&s->mu);
    const bool e = s->err_code != 0;
    pthread_mutex_unlock(&s->mu);
    return e;
}

int mf_error_take(mf_streamer * s, char * msg, size_t msg_size) {
    pthread_mutex_lock(&s->mu);
    const int code = s->err_code;
    if (msg && msg_size) {
        snprintf(msg, msg_size, "%s", code ? s->err_msg : "");
    }
    s->err_code   = 0;
    s->err_msg[0] = '\0';
    pthread_mutex_unlock(&s->mu);
    return code;
}
