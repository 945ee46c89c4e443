/* veloxquant — a qemu-user TCG plugin that counts the guest instructions a program executes and
 * prints the total at exit (BENCHMARKS.md section 12: instructions of the scalar and NEON paths
 * under emulation, where time is no measure). Declares the few entry points of QEMU's public plugin
 * API it uses (QEMU 7.2, plugin API version 1); Debian ships no qemu-plugin.h.
 *   cc -shared -fPIC -O2 -o insn_count.so insn_count.c
 *   qemu-aarch64 -plugin ./insn_count.so ./program ...    (prints "insns: N" to stderr) */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 = 0 };
typedef void (*tb_trans_cb)(qemu_plugin_id_t id, struct qemu_plugin_tb* tb);
typedef void (*udata_cb)(qemu_plugin_id_t id, void* userdata);

extern void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, tb_trans_cb cb);
extern size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb* tb);
extern void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb* tb,
                                                     enum qemu_plugin_op op, void* ptr,
                                                     uint64_t imm);
extern void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, udata_cb cb, void* userdata);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

/* One counter for every thread: exact for the single-threaded programs it is used on. */
static uint64_t insns;

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb* tb) {
  (void)id;
  /* Each execution of the block adds its instruction count. */
  qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &insns,
                                           qemu_plugin_tb_n_insns(tb));
}

static void on_exit_cb(qemu_plugin_id_t id, void* p) {
  (void)id;
  (void)p;
  fprintf(stderr, "insns: %llu\n", (unsigned long long)insns);
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id,
                                                               const void* info, int argc,
                                                               char** argv) {
  (void)info;
  (void)argc;
  (void)argv;
  qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
  qemu_plugin_register_atexit_cb(id, on_exit_cb, NULL);
  return 0;
}
