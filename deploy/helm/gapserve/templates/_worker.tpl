{{/* The pod of one tensor-parallel rank, shared by the StatefulSet (one node or
     several, rank = pod index) and the LeaderWorkerSet (rank = LWS_WORKER_INDEX). */}}
{{- define "gapserve.workerPod" -}}
{{- $full := include "gapserve.replicaName" . -}}
{{- $w := .Values.worker -}}
{{- $tp := .Values.tensorParallel -}}
{{- $res := deepCopy $w.resources -}}
{{- if gt (int $w.gpusPerRank) 0 -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" (int $w.gpusPerRank) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
metadata:
  labels:
    {{- include "gapserve.labels" . | nindent 4 }}
    {{- include "gapserve.replicaSelector" (list . "worker") | nindent 4 }}
  annotations:
    {{- include "gapserve.scrape" (list . $w.metricsPort) | nindent 4 }}
spec:
  {{- include "gapserve.podSecurity" . | nindent 2 }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets: {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: worker
      {{- include "gapserve.image" . | nindent 6 }}
      {{- if $tp.multiNode }}
      # LWS injects LWS_WORKER_INDEX (0 on the leader) and LWS_LEADER_ADDRESS (the
      # leader's DNS name); the kubelet expands $(VAR) in args from the environment
      args: ["worker", "--rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)"{{ range $w.extraArgs }}, {{ . | quote }}{{ end }}]
      {{- else }}
      args: ["worker"{{ range $w.extraArgs }}, {{ . | quote }}{{ end }}]
      {{- end }}
      env:
        {{- include "gapserve.commonEnv" . | nindent 8 }}
        {{- include "gapserve.modelEnv" . | nindent 8 }}
        {{- include "gapserve.limitsEnv" . | nindent 8 }}
        {{- if not $tp.multiNode }}
        # the StatefulSet's pod index (label since Kubernetes 1.28) is the rank
        - name: GAPSERVE_RANK
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
        - name: GAPSERVE_MASTER_ADDR
          value: {{ printf "%s-worker-0.%s.%s.svc" $full (include "gapserve.workersService" .) .Release.Namespace | quote }}
        {{- end }}
        - name: GAPSERVE_TENSOR_PARALLEL_SIZE
          value: {{ $tp.size | quote }}
        - name: GAPSERVE_MASTER_PORT
          value: {{ $w.rendezvousPort | quote }}
        - name: GAPSERVE_DISTRIBUTED_TIMEOUT
          value: {{ $w.distributedTimeout | quote }}
        - name: GAPSERVE_PORT
          value: {{ $w.port | quote }}
        - name: GAPSERVE_METRICS_PORT
          value: {{ $w.metricsPort | quote }}
        - name: GAPSERVE_DEVICE
          value: {{ $w.device | quote }}
        - name: GAPSERVE_DTYPE
          value: {{ $w.dtype | quote }}
        {{- if $w.kvCacheMemory }}
        - name: GAPSERVE_KV_CACHE_MEMORY
          value: {{ $w.kvCacheMemory | int64 | quote }}
        {{- end }}
      ports:
        - {name: grpc, containerPort: {{ $w.port }}, protocol: TCP}
        - {name: metrics, containerPort: {{ $w.metricsPort }}, protocol: TCP}
        - {name: rendezvous, containerPort: {{ $w.rendezvousPort }}, protocol: TCP}
      startupProbe:
        {{- include "gapserve.grpcProbe" (list . $w.port) | nindent 8 }}
        periodSeconds: {{ $w.startupProbe.periodSeconds }}
        failureThreshold: {{ $w.startupProbe.failureThreshold }}
      livenessProbe:
        {{- include "gapserve.grpcProbe" (list . $w.port) | nindent 8 }}
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: 3
      readinessProbe:
        {{- include "gapserve.grpcProbe" (list . $w.port) | nindent 8 }}
        periodSeconds: 5
        timeoutSeconds: 5
        failureThreshold: 2
      resources:
        {{- toYaml $res | nindent 8 }}
      {{- include "gapserve.containerSecurity" . | nindent 6 }}
      volumeMounts:
        - {name: shm, mountPath: /dev/shm}
        {{- include "gapserve.tlsVolumeMount" . | nindent 8 }}
  volumes:
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ $w.shmSize }}}
    {{- include "gapserve.tlsVolume" . | nindent 4 }}
  {{- with $w.nodeSelector }}
  nodeSelector: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.tolerations }}
  tolerations: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $w.affinity }}
  affinity: {{- toYaml $w.affinity | nindent 4 }}
  {{- else if and (gt (int $tp.size) 1) (not $tp.multiNode) }}
  # ranks of one engine prefer one node (NVLink/PCIe beats the network for NCCL)
  affinity:
    podAffinity:
      preferredDuringSchedulingIgnoredDuringExecution:
        - weight: 100
          podAffinityTerm:
            topologyKey: kubernetes.io/hostname
            labelSelector:
              matchLabels:
                {{- include "gapserve.replicaSelector" (list . "worker") | nindent 16 }}
  {{- end }}
{{- end -}}
