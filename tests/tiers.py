"""Which parametrized cases of a sweep run in the default tier, and which only with --slow.

A sweep repeats one check over SoCs or configurations. The default tier keeps
representative ones; the rest are marked ``slow`` with the reason the skip shows.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

# A check whose code path does not depend on the SoC, repeated on another HTP arch.
ANOTHER_ARCH = "the same check on another HTP arch (SoC sweep)"


def sweep(default: Iterable, more: Iterable, reason: str = ANOTHER_ARCH) -> list:
    """``default`` in every tier, then ``more`` only with --slow (skipped saying ``reason``)."""
    slow = pytest.mark.slow(reason=reason)
    return [*default, *(pytest.param(value, marks=slow) for value in more)]


# A strict xfail showing a defect of the QAIRT the plugin works around: it fails (XPASS)
# once QAIRT computes the case right, which only a QAIRT upgrade changes.
CANARY = "a canary on a QAIRT 2.51 defect, which only a QAIRT upgrade changes; "

# Long checks that run only with --slow, to keep the default tier within its time
# budget. Each names the default-tier check that covers the same code path, or what
# the check adds beyond it (tests/test_tiers.py checks that each names a test).
LONG: dict[str, str] = {
    "tests/test_zoo.py::test_mobilenet_v3_small_last_layers_within_fidelity": (
        "a MobileNetV3-Small step; the quick fidelity canary lowers and steps the same "
        "model every run"
    ),
    "tests/test_numerics.py::test_fidelity_command_prints_the_table_and_its_verdict": (
        "the developer fidelity command's printout of a lowered step"
    ),
    "tests/test_numerics.py::test_mobilenet_like_batch_norm_training_step_is_within_fidelity[affine]": (  # noqa: E501
        "a MobileNet-like train-mode step; test_train_mode steps the rewritten train-mode "
        "batch norms against torch and test_state_dict's test_htp_steps_track_torch "
        "lowered ones on the simulator"
    ),
    "tests/test_numerics.py::test_loss_scale_recovers_gradients_that_underflow_in_fp16": (
        "a numerics demonstration; the in-program loss scale is tested in test_optimizer"
    ),
    "tests/test_numerics.py::test_mobilenet_like_inference_at_1x1_and_2x2_spatial": (
        "inference fidelity at tiny maps; the canaries step MobileNets"
    ),
    "tests/test_train_mode.py::test_train_mode_batch_norm_trains_in_one_delegate[conv_bn]": (
        "train-mode batch norms lowered for SM8650 and stepped; test_state_dict's "
        "test_htp_steps_track_torch steps two in one delegate on the simulator and checks "
        "losses, parameters and running statistics against torch"
    ),
    "tests/test_train_mode.py::test_train_mode_batch_norm_trains_in_one_delegate[residual]": (
        "the residual variant; test_state_dict's test_htp_steps_track_torch runs the same "
        "lowering of train-mode batch norms"
    ),
    "tests/test_train_mode.py::test_train_mode_batch_norm_trains_in_one_delegate[bn1d]": (
        "the 1-D variant; test_state_dict's test_htp_steps_track_torch runs the same "
        "lowering of train-mode batch norms"
    ),
    "tests/test_train_mode.py::test_train_mode_batch_norm_trains_with_weights_in_torch_layout[residual]": (  # noqa: E501
        "the residual variant of the torch layout; test_weight_layout lowers and runs the "
        "torch layout"
    ),
    "tests/test_train_mode.py::test_stock_flow_lowers_train_mode_batch_norm": (
        "the stock flow; test_training trains through it after enable()"
    ),
    "tests/test_train_mode.py::test_forward_program_in_train_mode_lowers": (
        "a forward-only program in train(); the training programs lower the same forward"
    ),
    "tests/test_property.py::test_compiled[default]": (
        "generated configurations compiled and run; test_core runs generated "
        "configurations on the simulator"
    ),
    "tests/test_property.py::test_visitor_and_validation[default]": (
        "generated configurations through QNN's validation; test_core runs generated "
        "configurations on the simulator"
    ),
    "tests/test_finetune.py::test_fit_torch_copy_drops_what_the_program_drops": (
        "two CPU-only fits with dropout; fit's tracking of torch is tested without it"
    ),
    "tests/test_finetune.py::test_fit_with_adamw_in_the_program_tracks_torch_adamw": (
        "three AdamW fits; the in-program AdamW is tested against torch in test_optimizer"
    ),
    "tests/test_finetune.py::test_fit_resumes_adamw_from_its_checkpoint_to_the_bit": (
        "three AdamW fits; finetune's resume is tested to the bit in test_finetune_tool"
    ),
    "tests/test_finetune.py::test_fit_cpu_only_program_tracks_torch": (
        "a CPU-only fit; test_finetune_tool's run fits the CPU-only program and checks its "
        "losses against torch's, and test_fit_on_the_simulator_tracks_torch checks the "
        "tracking and the evaluation schedule"
    ),
    "tests/test_finetune.py::test_cli_end_to_end_writes_png": (
        "the command end to end; test_finetune_tool runs it"
    ),
    "tests/test_finetune.py::test_fit_drops_odd_sized_loader_batches": (
        "a CPU-only fit from a DataLoader with a short last batch"
    ),
    "tests/test_finetune.py::test_fit_torch_copy_starts_from_torch_start": (
        "a CPU-only fit whose torch copy starts from other weights; "
        "test_fit_on_the_simulator_tracks_torch runs fit's torch copy from the model's"
    ),
    "tests/test_conv_batch_norm.py::test_a_fully_trained_folded_program_trains_with_executorchs_training_runtime[fold]": (  # noqa: E501
        "another folding option; test_a_folded_program_trains_with_executorchs_training_"
        "runtime runs the same runtime"
    ),
    "tests/test_conv_batch_norm.py::test_a_fully_trained_folded_program_trains_with_executorchs_training_runtime[fold_device]": (  # noqa: E501
        "another folding option; test_a_folded_program_trains_with_executorchs_training_"
        "runtime runs the same runtime"
    ),
    "tests/test_conv_batch_norm.py::test_trained_pairs_fold_on_the_device_and_compute_the_same_step[conv]": (  # noqa: E501
        "another variant; [full] folds the same pairs"
    ),
    "tests/test_conv_batch_norm.py::test_trained_pairs_fold_on_the_device_and_compute_the_same_step[full-zero-gammas]": (  # noqa: E501
        "another variant; [full] folds the same pairs"
    ),
    "tests/test_conv_batch_norm.py::test_an_observer_sees_each_folded_weight_and_the_pass_keeps_none": (  # noqa: E501
        "a lowering with an observer; test_a_folded_weight_is_stored_once checks the stored weights"
    ),
    "tests/test_conv_batch_norm.py::test_a_fully_trained_folded_step_is_within_fidelity_and_closer_to_fp32": (  # noqa: E501
        "a fidelity comparison of folding; the folded programs' steps are tested above"
    ),
    "tests/test_context_cache.py::test_another_soc_compiles_again": (
        "a second compile for another key field; test_a_changed_static_weight_compiles_"
        "again checks a changed key compiles"
    ),
    "tests/test_context_cache.py::test_another_option_compiles_again": (
        "a second compile for another key field; test_a_changed_static_weight_compiles_"
        "again checks a changed key compiles"
    ),
    "tests/test_context_cache.py::test_split_delegates_each_reuse_their_binary": (
        "a split program's two compiles; test_the_same_program_again_reuses_the_binary checks reuse"
    ),
    "tests/test_lowering_cache.py::test_a_lowering_whose_qnn_graphs_are_captured_is_built": (
        "a lowering with its QNN graphs captured"
    ),
    "tests/test_lowering_cache.py::test_switched_off_it_stores_no_lowering": (
        "a lowering with the cache off; test_context_cache checks the switch"
    ),
    "tests/test_toolchain.py::test_finalize_level_1_computes_a_strided_weight_gradient_right": (
        "the non-default finalisation level 1"
    ),
    "tests/test_cost.py::test_measured_demo_macs_by_hand": (
        "the developer cost tool on a lowered demo"
    ),
    "tests/test_bench.py::test_counts_on_lowered_programs_with_and_without_the_plugin": (
        "the developer benchmark's counts on two lowerings"
    ),
    "tests/test_profile.py::test_delegate_bytes_are_the_tensors_each_call_is_given": (
        "the developer profiler on the simulator; the CPU-only profile tests read ETDump "
        "the same way"
    ),
    "tests/test_profile.py::test_delegate_roles_name_the_trained_weights_both_ways": (
        "the developer profiler on the simulator; the CPU-only profile tests read ETDump "
        "the same way"
    ),
    "tests/test_profile.py::test_simulator_delegate_calls_and_cpu_ops_are_the_plans": (
        "the developer profiler on the simulator; the CPU-only profile tests read ETDump "
        "the same way"
    ),
    "tests/test_fp16_boundary.py::test_the_delegate_reads_fp32_parameters_as_their_fp16_roundings": (  # noqa: E501
        "a measurement behind the parameters' dtype at the delegate's boundary"
    ),
    "tests/test_fp16_boundary.py::test_the_delegate_writes_values_fp16_outputs_would_not_hold": (
        "a measurement behind the gradients' dtype at the delegate's boundary"
    ),
    "tests/test_state_dict.py::test_dropout_step_counter_is_not_in_the_state_dict": (
        "a dropout program's state_dict keys"
    ),
    "tests/test_dropout.py::test_one_shared_mask_trains_as_two_on_the_simulator": (
        "a shared mask on the simulator; a CPU run of the rewritten graphs checks the "
        "sharing to the bit"
    ),
    "tests/test_finetune_tool.py::test_resume_from_the_last_checkpoint_ends_as_the_run": (
        "a second resume of the run; test_a_killed_run_resumes_to_the_same_losses_to_the_bit "
        "resumes it to the bit"
    ),
    "tests/test_finetune_quantized.py::test_quantized_run_resumes_to_the_same_run": (
        "a resumed quantized run; test_finetune_tool resumes a killed run to the bit and "
        "test_a_resume_whose_backbone_differs_is_refused checks the quantized resume's "
        "digest"
    ),
    "tests/test_lowering_cache.py::test_a_new_process_reads_it_back": (
        "the read-back in a second process; test_the_same_program_again_is_read_back_and_"
        "trains_the_same reads the stored lowering back"
    ),
    "tests/test_train_mode.py::test_train_mode_batch_norm_trains_with_weights_in_torch_layout[conv_bn]": (  # noqa: E501
        'the non-default weight_layout="torch"'
    ),
    "tests/test_context_cache.py::test_the_environment_variable_turns_it_off": (
        "the environment variable's switch, two compiles"
    ),
    "tests/test_context_cache.py::test_the_cli_progress_line_names_phase_and_delegate": (
        "the CLI's progress line on a real compile; test_the_cli_progress_line_follows_long_"
        "calls_without_replacing_them checks the line's wiring"
    ),
    "tests/test_toolchain.py::test_htp_optimization_reaches_the_graph_config": (
        "the optimisation option's way into QNN's graph config, two compiles"
    ),
    "tests/test_sigmoid.py::test_tanh_sigmoid_brings_every_gradient_of_a_silu_step_closer": (
        "a fidelity comparison of two SiLU lowerings; test_every_sigmoid_of_a_joint_graph_"
        "becomes_tanh_with_the_same_values checks the rewrite"
    ),
    "tests/test_training.py::test_executorch_cifar_example_trains_like_torch[frozen-features]": (
        "the frozen-features variant; [trainable] trains the same example"
    ),
    "tests/test_state_dict.py::test_program_state_resumes_an_in_program_optimizer_to_the_bit": (
        "in-program SGD's state; test_optimizer resumes an in-program AdamW from its state "
        "dicts to the bit"
    ),
    "tests/test_cpu1d.py::test_skip_options_keep_1d_nodes_on_cpu[op]": (
        "every 1-D convolution backward kept on CPU by the op skip; "
        "test_v68_runs_every_1d_node_on_cpu_as_2d runs them all on CPU as 2-D, and "
        "test_core's test_skip_options_keep_every_node_on_cpu_and_the_program_runs keeps "
        "every node on CPU by the op skip"
    ),
    "tests/test_cpu1d.py::test_skip_options_keep_1d_nodes_on_cpu[id]": (
        "a 1-D node kept on CPU by its id beside delegated ones; test_core's "
        "test_skip_node_id_set_keeps_the_named_node_though_a_split_renumbers_nodes keeps "
        "the named node after the renumbering, test_gates's "
        "test_variant[conv1d_float64_all_gradients] runs a 1-D node kept on CPU for SM8650 "
        "as 2-D, and test_v68_runs_every_1d_node_on_cpu_as_2d lifts every 1-D node"
    ),
    "tests/test_core.py::test_frozen_backbone_training_graph[stride2_block-10]": (
        "the strided block at an even size; [stride2_block-9] runs the same check on it"
    ),
    "tests/test_dropout.py::test_cifar_train_decides_one_delegate_with_the_draw_on_cpu": (
        "decide() on the CIFAR model; test_cifar_train_is_one_delegate lowers it"
    ),
    "tests/test_max_pool_zoo.py::test_resnet18_pool_backward_is_delegated": (
        "a whole resnet18 lowered bias-only for its stem's pool; test_max_pool's "
        "test_training_graph_pool_backward_on_htp[k3s2p1_resnet] runs the same pool's "
        "backward on the HTP against torch"
    ),
    "tests/test_max_pool_zoo.py::test_resnet18_whole_graph_gradients_match_torch": (
        "the same resnet18 lowering's gradients; test_numerics's test_batch_norm_becomes_"
        "elementwise_ops_and_a_trained_weight_stays_a_read checks the batch-norm rewrite "
        "that fixed them"
    ),
    "tests/test_finetune_tool.py::test_a_warm_start_carries_the_weights_statistics_and_dropout_masks_on": (  # noqa: E501
        "a float run with a warm start; test_finetune_quantized's test_the_warm_start_trains_"
        "the_head_alone_then_the_adapters checks the phases, their fresh optimizers and the "
        "evaluations, and this adds the running statistics and the dropout counter carried "
        "across the phases"
    ),
    "tests/test_finetune_quantized.py::test_a_resume_in_either_phase_ends_as_the_straight_run[8]": (  # noqa: E501
        "a resume in the head's phase; [24] resumes the same run in the adapters' phase to "
        "the bit, and test_finetune_tool resumes a one-phase run to the bit"
    ),
    "tests/test_finetune_quantized.py::test_a_resume_in_either_phase_ends_as_the_straight_run[20]": (  # noqa: E501
        "a resume from the checkpoint written as the adapters' phase starts; [24] resumes "
        "in that phase to the bit"
    ),
    "tests/test_finetune_quantized.py::test_head_epochs_0_trains_the_adapters_from_the_first_step": (  # noqa: E501
        "a quantized adapter run without the warm start; test_the_warm_start_defaults_and_"
        "refusals checks --head-epochs 0's options and test_finetune_tool runs one-phase "
        "fits"
    ),
    "tests/test_finetune_quantized.py::test_adapters_train_inside_the_quantized_backbone": (
        "the adapter scheme's quantized finetune run; test_quantized_run_writes_its_outputs "
        "runs the quantized command and test_quantized_ste's test_a_float_adapter_inside_"
        "the_backbone_trains_and_the_rest_is_quantized builds the adapters inside"
    ),
    "tests/test_lowering_cache.py::test_a_program_whose_read_back_emits_other_bytes_is_not_stored": (  # noqa: E501
        "the refusal of an entry whose read-back differs, one more lowering; "
        "test_the_same_program_again_is_read_back_and_trains_the_same checks the read-back"
    ),
    "tests/test_split.py::test_split_keeps_max_pool_indices_inside_one_delegate": (
        "a CIFAR model split small, its pool indices inside one delegate; "
        "test_split_demo_trains_as_one_delegate_does splits a program and trains it"
    ),
    "tests/test_weight_layout.py::test_other_convolutions_compute_what_the_torch_layout_computes": (  # noqa: E501
        "strided, grouped, dilated and 3-D convolutions in both layouts; test_weights_enter_"
        "and_gradients_leave_in_the_filter_layout checks the layout"
    ),
    "tests/test_conv_batch_norm.py::test_a_folded_weight_is_stored_once": (
        "the folded weights' storage; test_folded_bias_only_step_is_one_delegate_and_within_"
        "fidelity lowers and steps a folded program"
    ),
    "tests/test_conv_batch_norm.py::test_a_trained_convolution_weight_is_not_folded_with_fold_frozen": (  # noqa: E501
        "another refusal to fold; test_a_trained_batch_norm_weight_is_not_folded_and_says_why "
        "checks the refusal and its reason"
    ),
    "tests/test_parallel_finalize.py::test_parallel_program_trains_exactly_as_the_in_process_one": (  # noqa: E501
        "a program finalised in forked processes, trained; test_forked_finalisation_stores_"
        "and_reuses_context_binaries finalises one in forked processes"
    ),
    "tests/test_saver.py::test_joint_graph_transpose_conv_reads_the_forward_weight": (
        "a joint graph through the Saver; test_small_conv_ops_and_tensor_types records a "
        "lowering with it"
    ),
    "tests/test_context_cache.py::test_the_stock_flow_reports_progress_and_uses_the_cache": (
        "executorch's own flow with the cache; test_the_same_program_again_reuses_the_binary "
        "checks the reuse through lower()"
    ),
    "tests/test_train_mode.py::test_batch_norm_in_eval_inside_a_training_model_keeps_frozen_statistics": (  # noqa: E501
        "an eval batch norm in a training model; test_optimizer's test_a_frozen_eval_batch_"
        "norm_trains_on_the_htp lowers and steps one"
    ),
    "tests/test_full_backward.py::test_fully_trainable_network_runs_every_backward_on_htp[mobilenet-SM8850]": (  # noqa: E501
        "the MobileNet-like backbone; [resnet-SM8550] runs the same check"
    ),
    "tests/test_full_backward.py::test_conv1d_backward_lowers_through_the_2d_path[frozen]": (
        "the frozen variant; [trainable] lowers the same 1-D backward"
    ),
    "tests/test_split.py::test_split_demo_trains_as_one_delegate_does[15]": (
        "a coarser split of the same demo; [6] splits and trains it"
    ),
    "tests/test_padding_defect.py::test_grad_weight_where_taps_read_only_padding_matches_torch[depthwise-7x7-at-3x3]": (  # noqa: E501
        "a 7x7 kernel at 3x3; [depthwise-5x5-at-2x2] runs the same plan on a depthwise "
        "convolution whose taps read only padding"
    ),
    "tests/test_distribute_mul.py::test_distributed_product_is_at_the_fp16_floor[SM8850]": (
        "the same check on V81; [SM8650] runs it on V75"
    ),
    "tests/test_train_mode.py::test_v68_trains_train_mode_batch_norm_on_cpu": (
        "train-mode batch norms stepped on V68's CPU kernels; test_state_dict's "
        "test_cpu_steps_match_torch_sgd steps a V68 program of two train-mode batch norms "
        "with executorch's SGD and checks losses and running statistics against torch"
    ),
    "tests/test_train_mode.py::test_rewritten_program_steps_as_torch_eager[bn1d_cumulative]": (
        "a 1-D cumulative average; [bn1d] rewrites the 1-D batch norms and "
        "[bn2d_cumulative] the cumulative average"
    ),
    "tests/test_context_cache.py::test_a_corrupt_entry_is_compiled_again": (
        "a lowering over a corrupt entry; test_a_bad_entry_is_detected_logged_and_deleted "
        "checks the detection and test_a_changed_static_weight_compiles_again a compile "
        "where no entry is taken"
    ),
    "tests/test_max_pool.py::test_training_graph_pool_backward_kept_on_cpu_is_right[v68]": (
        "the V68 rule keeping the pool backward on CPU; [skip_op] runs the same rewritten "
        "backward on CPU against torch, and test_verdicts's "
        "test_the_rule_is_the_verdict[graph:training_graph_below_v69] checks the rule"
    ),
    "tests/test_max_pool_forward.py::test_v68_keeps_the_forward_on_cpu": (
        "the V68 rule keeping the forward pools on CPU; test_backward_kept_on_cpu_keeps_"
        "the_forward_on_cpu keeps the same graph's pools on CPU and checks the step, and "
        "test_verdicts's [graph:training_graph_below_v69] checks the rule"
    ),
    "tests/test_full_backward.py::test_split_keeps_each_gradient_in_its_own_node": (
        "one node asking for every gradient; test_weight_bias_and_dilated_gradients_match_"
        "aten[SM8850] lowers such nodes (CONFIGS[0] among them) and checks each output"
    ),
    "tests/test_conv_batch_norm.py::test_folded_bias_only_step_is_one_delegate_and_within_fidelity": (  # noqa: E501
        "a folded bias-only step's fidelity; test_a_folded_program_trains_with_executorchs_"
        "training_runtime lowers a folded bias-only program to one delegate and trains it "
        "beside torch, and test_frozen_pairs_fold_and_grad_input_reads_the_folded_weight "
        "folds this graph"
    ),
    "tests/test_optimizer.py::test_sgd_follows_torch_and_equals_executorchs_sgd[nesterov]": (
        "two CPU lowerings, to compare the in-program SGD with executorch's SGD to the bit; "
        "test_a_frozen_eval_batch_norm_trains_like_torch[sgd] checks the in-program SGD "
        "with Nesterov momentum and weight decay against torch.optim"
    ),
    "tests/test_strided_scatter.py::test_the_heads_joint_graph_holds_a_covering_scatter_that_decide_delegates": (  # noqa: E501
        "decide() on the head's joint graph; test_the_head_trains_on_htp_next_to_torch "
        "checks that the same graph holds a covering scatter and lowers it with no scatter "
        "on CPU"
    ),
    "tests/test_hardswish.py::test_qnn_hardswish_decomposition_is_at_the_fp16_floor": (
        CANARY + "test_centred_hard_activations_are_at_the_fp16_floor checks the centred rewrite "
        "that avoids it"
    ),
    "tests/test_scalar_constants.py::test_qnn_multiplication_by_a_sixth_is_unbiased": (
        CANARY + "test_paired_constants_are_unbiased_on_the_htp checks the paired constants that "
        "avoid it"
    ),
    "tests/test_distribute_mul.py::test_qnn_product_of_a_constant_sum_is_unbiased": (
        CANARY + "test_distributed_product_is_at_the_fp16_floor[SM8650] checks the distributed "
        "product that avoids it"
    ),
    "tests/test_sigmoid.py::test_qnn_sigmoid_is_at_the_fp16_floor": (
        CANARY
        + "test_plugin_sigmoid_is_at_the_fp16_floor[SM8850] checks the tanh form that avoids "
        "it"
    ),
    "tests/test_padding_defect.py::test_executorch_lowers_a_convolution_whose_padding_reaches_its_kernel_right": (  # noqa: E501
        CANARY + "test_a_forward_convolution_whose_padding_reaches_its_kernel_stays_on_cpu checks "
        "the rule that avoids it"
    ),
    "tests/test_max_pool.py::test_scatter_add_formulation_compiles_on_htp": (
        CANARY + "the pool backward's default formulation is lowered and checked by "
        "test_training_graph_pool_backward_on_htp"
    ),
    "tests/test_max_pool_forward.py::test_executorch_lowers_a_padded_two_by_two_max_pool_right": (
        CANARY + "test_values_only_padded_pool_matches_torch checks the Maximum chain that "
        "avoids it"
    ),
}
