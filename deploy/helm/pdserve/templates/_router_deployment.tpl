{{/* One router Deployment (see router-deployment.yaml): the pool owner (`only` false) or the
     extra routers of router.replicas > 1 (`only` true, `pdserve up --router-only`). Both run
     the same image, config map, secrets, TLS and probes; the Service selects both. */}}
{{- define "pdserve.routerDeployment" -}}
{{- $only := .only -}}
{{- $component := ternary "router-replica" "router" $only -}}
{{- with .ctx -}}
{{- $redisSecret := include "pdserve.redisPasswordSecret" . -}}
{{- $tokenSecret := include "pdserve.apiTokenSecret" . -}}
{{- $tls := .Values.router.tls -}}
{{- $secrets := include "pdserve.secretsDir" . -}}
{{- include "pdserve.checkNoLiteralSecrets" . -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.fullname" . }}-{{ $component }}
  labels:
    {{- include "pdserve.labels" . | nindent 4 }}
    app.kubernetes.io/component: {{ $component }}
spec:
  {{- if $only }}
  # Extra routers, each `pdserve up --router-only`: the worker table comes from the pool
  # owner's registry, so they roll one at a time and never all at once.
  replicas: {{ sub (include "pdserve.routerReplicas" . | int) 1 }}
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxUnavailable: 0, maxSurge: 1}
  {{- else }}
  # The pool owner (`pdserve up`: the Ray driver of every worker): exactly one, never two at
  # once.
  replicas: 1
  strategy:
    type: Recreate
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
      app.kubernetes.io/component: {{ $component }}
  template:
    metadata:
      labels:
        {{- include "pdserve.selectorLabels" . | nindent 8 }}
        app.kubernetes.io/component: {{ $component }}
        {{- include "pdserve.routerFrontLabel" . | nindent 8 }}
      annotations:
        checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
        {{- with .Values.router.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml .Values.podSecurityContext | nindent 8 }}
      # preStop sleep + drain + 15 s for the stop itself (values.yaml, router.drainTimeoutSeconds)
      terminationGracePeriodSeconds: {{ add .Values.router.preStopSleepSeconds .Values.router.drainTimeoutSeconds 15 }}
      containers:
        - name: router
          image: {{ include "pdserve.image" . }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          securityContext:
            {{- toYaml .Values.containerSecurityContext | nindent 12 }}
          # Join the Ray cluster as a 0-CPU node, then run `pdserve up` as a driver on it (the
          # pool owner; or --router-only: a router of the owner's workers, no pools of its own).
          # router.extraArgs arrive as "$@" (no shell quoting to get wrong).
          command:
            - /bin/sh
            - -c
            - |
              set -e
              ray start --address="$RAY_HEAD:6379" --node-ip-address="$POD_IP" --num-cpus=0 --num-gpus=0
              {{- if $only }}
              exec pdserve up --config /etc/pdserve/config/pdserve.yaml --ray-address auto --router-only --host "$POD_IP" "$@"
              {{- else }}
              exec pdserve up --config /etc/pdserve/config/pdserve.yaml --ray-address auto --worker-host auto --host "$POD_IP" "$@"
              {{- end }}
            - pdserve-router
          {{- with .Values.router.extraArgs }}
          args:
            {{- range . }}
            - {{ toString . | quote }}
            {{- end }}
          {{- end }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            # The router, metrics and bundled Redis bind the pod IP, never 0.0.0.0.
            - name: PDSERVE_HOST
              value: $(POD_IP)
            - name: RAY_HEAD
              value: {{ include "pdserve.rayHead" . | quote }}
            {{- with .Values.redis.external.url }}
            - name: PDSERVE_REDIS_URL
              value: {{ . | quote }}
            {{- end }}
            {{- if $redisSecret }}
            - name: PDSERVE_REDIS_PASSWORD
              valueFrom:
                secretKeyRef:
                  name: {{ $redisSecret }}
                  key: {{ include "pdserve.redisPasswordKey" . }}
            {{- end }}
            # The worker plane's secret, as a file: the owner hands it to the workers it
            # starts (Ray runtime_env), every router signs its worker RPCs with it; never argv
            # or a log line.
            - name: PDSERVE_CLUSTER_SECRET_FILE
              value: {{ printf "%s/cluster-secret" $secrets | quote }}
            {{- with .Values.router.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ .Values.router.grpcPort }}
              protocol: TCP
            - name: metrics
              containerPort: {{ .Values.router.metricsPort }}
              protocol: TCP
            {{- if .Values.router.httpPort }}
            - name: http
              containerPort: {{ .Values.router.httpPort }}
              protocol: TCP
            {{- end }}
          {{- with .Values.router.preStopSleepSeconds }}
          # out of the Service's endpoints before SIGTERM starts the drain
          lifecycle:
            preStop:
              exec:
                command: ["sleep", {{ . | quote }}]
          {{- end }}
          # startup: the port is open; liveness: the process is alive (never the serving
          # status, issue 16 finding 12); readiness: it can serve. See pdserve.routerProbes.
          {{- include "pdserve.routerProbes" . | nindent 10 }}
          resources:
            {{- toYaml .Values.router.resources | nindent 12 }}
          volumeMounts:
            - name: config
              mountPath: /etc/pdserve/config
              readOnly: true
            - name: secrets
              mountPath: {{ $secrets }}
              readOnly: true
            {{- include "pdserve.rayVolumeMounts" . | nindent 12 }}
            {{- if .Values.clusterTLS.secretName }}
            {{- include "pdserve.clusterTLSMount" . | nindent 12 }}
            {{- end }}
      volumes:
        - name: config
          configMap:
            name: {{ include "pdserve.fullname" . }}
        # Every secret the router reads, as files readable by its group (fsGroup) only.
        - name: secrets
          projected:
            defaultMode: 0440
            sources:
              - secret:
                  name: {{ include "pdserve.clusterSecretName" . }}
                  items:
                    - key: {{ include "pdserve.clusterSecretKey" . }}
                      path: cluster-secret
              {{- if $tokenSecret }}
              - secret:
                  name: {{ $tokenSecret }}
                  items:
                    - key: {{ include "pdserve.apiTokenKey" . }}
                      path: api-tokens
              {{- end }}
              {{- if $tls.secretName }}
              - secret:
                  name: {{ $tls.secretName }}
                  items:
                    - {key: tls.crt, path: tls/tls.crt}
                    - {key: tls.key, path: tls/tls.key}
              {{- end }}
              {{- if $tls.clientCASecretName }}
              - secret:
                  name: {{ $tls.clientCASecretName }}
                  items:
                    - key: {{ $tls.clientCAKey }}
                      path: tls/client-ca.crt
              {{- end }}
        {{- include "pdserve.rayVolumes" .Values.router | nindent 8 }}
        {{- if .Values.clusterTLS.secretName }}
        {{- include "pdserve.clusterTLSVolume" . | nindent 8 }}
        {{- end }}
      {{- with .Values.router.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.router.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.router.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
{{- end -}}
