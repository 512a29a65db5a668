/* A driver for the harnesses without libFuzzer: feeds every file of the directories (and files)
 * it is given to LLVMFuzzerTestOneInput once, in name order. The ordinary builds (gcc, plain and
 * ASan + UBSan) run each harness this way over its seed corpus and its regression inputs as a meson
 * test, so that every finding stays fixed in the suite's own runs too. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        perror(path);
        return 1;
    }
    uint8_t *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            cap = cap == 0 ? 4096 : cap * 2;
            uint8_t *nb = realloc(buf, cap);
            if (nb == NULL) {
                free(buf);
                fclose(f);
                return 1;
            }
            buf = nb;
        }
        size_t k = fread(buf + len, 1, cap - len, f);
        if (k == 0) {
            break;
        }
        len += k;
    }
    fclose(f);
    (void)LLVMFuzzerTestOneInput(buf, len);
    free(buf);
    return 0;
}

static int by_name(const struct dirent **x, const struct dirent **y)
{
    return strcmp((*x)->d_name, (*y)->d_name);
}

int main(int argc, char **argv)
{
    int n = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            continue; /* a harness without regression inputs has no directory for them */
        }
        if (!S_ISDIR(st.st_mode)) {
            if (replay_file(argv[i]) != 0) {
                return 1;
            }
            n++;
            continue;
        }
        struct dirent **ents;
        int m = scandir(argv[i], &ents, NULL, by_name);
        if (m < 0) {
            perror(argv[i]);
            return 1;
        }
        for (int k = 0; k < m; k++) {
            char path[4096];
            snprintf(path, sizeof(path), "%s/%s", argv[i], ents[k]->d_name);
            if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
                if (replay_file(path) != 0) {
                    return 1;
                }
                n++;
            }
            free(ents[k]);
        }
        free(ents);
    }
    printf("replayed %d inputs\n", n);
    return n > 0 ? 0 : 1;
}
