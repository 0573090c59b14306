// Fiber stack switching for the CPU simulator (x86-64 System V), host assembly.
//
// cuflash_sim_switch_stack(void** save_sp, void* next_sp): pushes the callee-saved
// registers, MXCSR and the x87 control word on the current stack, stores %rsp in
// *save_sp, loads next_sp and pops the same frame from it. Only what the ABI says a
// callee must preserve is saved, which is why a switch costs ~10 ns where glibc's
// swapcontext (which also makes a sigprocmask system call) costs ~550 ns.
//
// cuflash_sim_fiber_trampoline: where a new fiber's first frame "returns" to; it
// calls cuflash_sim_fiber_main(%rbx = Fiber*), which never returns.

  .text
  .p2align 4
  .globl cuflash_sim_switch_stack
  .hidden cuflash_sim_switch_stack
  .type cuflash_sim_switch_stack, @function
cuflash_sim_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  fnstcw (%rsp)
  stmxcsr 8(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuflash_sim_switch_stack, .-cuflash_sim_switch_stack

  .p2align 4
  .globl cuflash_sim_fiber_trampoline
  .hidden cuflash_sim_fiber_trampoline
  .type cuflash_sim_fiber_trampoline, @function
cuflash_sim_fiber_trampoline:
  movq %rbx, %rdi
  call cuflash_sim_fiber_main
  ud2
  .size cuflash_sim_fiber_trampoline, .-cuflash_sim_fiber_trampoline

  .section .note.GNU-stack,"",@progbits
